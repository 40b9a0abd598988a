"""What the lesson pages and the Computation times pages add to Sphinx-Gallery's own.

* Each plot is a link to its image, so a click opens it full size: Sphinx-Gallery writes the
  ``<img>`` of its ``image-sg`` directive itself, and this extension wraps that tag in a link to
  the same file.
* ``PeakMemory`` is the build's ``show_memory``: the memory figure of each lesson's footer and of
  the Computation times pages.
* The Computation times pages (``sg_execution_times``) lose the raw HTML block that Sphinx-Gallery
  puts in them to load jQuery, DataTables and Bootstrap from CDNs (it only makes the table
  sortable, and the table is already sorted by time), and gain a sentence on what the memory
  column measures.
"""

import re
from pathlib import Path

from sphinx_gallery.directives import depart_imgsg_html, imgsgnode, visit_imgsg_html


class PeakMemory:
    """Runs a piece of a lesson and returns the most memory, in MB, the build process held meanwhile,
    with the piece's result; Sphinx-Gallery reports the largest of these less the lesson's start.

    Linux keeps the peak resident size (VmHWM) and resets it on request, so the figure is exact where
    sampling would miss short peaks; the build runs only on Linux, as Triton does. An instance, not a
    function, so that Sphinx can cache the configuration that holds it."""

    def __call__(self, func):
        Path("/proc/self/clear_refs").write_text("5")
        result = func()
        peak_kb = re.search(r"^VmHWM:\s*(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1)
        return int(peak_kb) / 1024, result

    def __eq__(self, other):
        return isinstance(other, PeakMemory)

    def __hash__(self):
        return hash(PeakMemory)

    def __repr__(self):
        return "PeakMemory()"


def _visit_plot(self, node):
    start = len(self.body)
    visit_imgsg_html(self, node)
    src = re.search(r'<img\b[^>]*\bsrc="([^"]*)"', "".join(self.body[start:])).group(1)
    self.body.insert(start, f'<a class="reference internal image-reference plot-full-size" href="{src}">')


def _depart_plot(self, node):
    depart_imgsg_html(self, node)
    self.body.append("</a>")


# The block runs from ".. raw:: html" to the table that follows it.
CDN_BLOCK = re.compile(r"^( *)\.\. raw:: html\n.*?(?=^\1\.\. list-table::)", re.M | re.S)
MEMORY_NOTE = (
    "Mem (MB) is the most resident memory the build process gained while the lesson ran, over what it "
    "held when the lesson started. The lessons run one after another in one process (one per worker "
    "when the build runs on several GPUs): the first of a process also pays for importing PyTorch and "
    "Triton, and a later one that reuses memory freed before it can show almost nothing.\n\n")


def _computation_times(app, docname, source):
    if docname.split("/")[-1] == "sg_execution_times":
        text = CDN_BLOCK.sub("", source[0])
        source[0] = text.replace(".. container::", MEMORY_NOTE + ".. container::", 1)


def setup(app):
    app.add_node(imgsgnode, override=True, html=(_visit_plot, _depart_plot))
    app.connect("source-read", _computation_times)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
