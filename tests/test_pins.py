"""Every install is pinned: requirements.txt's direct pins agree with constraints.txt, which pins the rest."""

import re

from conftest import ROOT


def pins(name):
    """{normalized package name: version} for every `name==version` line of a requirements-style file."""
    found = {}
    for line in (ROOT / name).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            assert "==" in line, f"{name}: '{line}' is not pinned to one version"
            package, version = line.split("==")
            found[re.sub(r"[-_.]+", "-", package).lower()] = version
    return found


def test_constraints_pin_every_direct_requirement_at_the_same_version():
    direct, everything = pins("requirements.txt"), pins("constraints.txt")
    assert {p: v for p, v in direct.items() if everything.get(p) != v} == {}
    assert len(everything) > len(direct)
