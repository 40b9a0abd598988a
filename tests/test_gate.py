"""The correctness gate of the site build: a kernel that returns a NaN anywhere fails the build, and the
message names the lesson and the tensor. (The GPU build is the only place the Gluon kernels run, so this
gate is what stands between a wrong kernel and a published page.)"""

import shutil

from conftest import ROOT, TUTORIALS, sphinx


def test_a_planted_nan_fails_the_build_by_lesson_and_tensor(site, tmp_path):
    # A copy of the sources with the generated gallery, so that only the changed lesson runs again.
    shutil.copytree(ROOT / "docs", tmp_path / "docs")
    shutil.copytree(TUTORIALS, tmp_path / "tutorials")
    lesson = tmp_path / "tutorials" / "07-fused-attention-v2-backward.py"
    source = lesson.read_text()
    backward_end = "    return (dq.to(q.dtype) if atomic_dq else dq), dk, dv\n"
    assert source.count(backward_end) == 1, "the planted NaN needs a new place: the portable backward changed"
    planted = "    dq.view(-1)[dq.numel() // 2] = float('nan')  # planted\n"
    lesson.write_text(source.replace(backward_end, planted + backward_end))
    result = sphinx(tmp_path, tmp_path / "build")
    output = result.stdout + result.stderr
    assert result.returncode != 0, "a NaN in dq did not fail the build"
    assert "07-fused-attention-v2-backward" in output and "dq is off" in output, output[-3000:]
