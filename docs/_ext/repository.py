"""Links into the project's GitHub repository, all from the ``repository`` setting (``owner/name``) of
conf.py and its ``repository_branch``.

* Pages whose source is a file of the repository get ``repository_source`` in their template context
  (``view`` and ``edit`` URLs of that file on the branch), which ``_templates/source-links.html``
  shows. A lesson's source is its script in the examples folder, not the page Sphinx-Gallery
  generates from it; generated pages without a script of their own get no link.
* The ``repository-code`` directive is a ``code-block`` in which ``{{ repository_url }}`` and
  ``{{ repository_name }}`` stand for this build's repository, so that a command such as
  ``git clone`` is written once and always names the repository the site was built from.
"""

import re
from pathlib import Path

from docutils.statemachine import StringList
from sphinx.directives.code import CodeBlock
from sphinx.errors import ConfigError


def repository_url(config):
    return f"https://github.com/{config.repository}"


def _check(app, config):
    if not re.fullmatch(r"[\w.-]+/[\w.-]+", config.repository):
        raise ConfigError(f"repository must be 'owner/name' on GitHub, not {config.repository!r}")


def _generated_sources(app):
    """{docname: script} for the pages Sphinx-Gallery writes from a script, and the folders it writes into."""
    gallery = app.config.sphinx_gallery_conf
    examples, galleries = gallery["examples_dirs"], gallery["gallery_dirs"]
    pairs = zip([examples] if isinstance(examples, str) else examples,
                [galleries] if isinstance(galleries, str) else galleries)
    scripts, folders = {}, []
    for examples_dir, gallery_dir in pairs:
        folders.append(gallery_dir)
        for script in Path(app.confdir, examples_dir).glob("*.py"):
            scripts[f"{gallery_dir}/{script.stem}"] = script.resolve()
    return scripts, folders


def source_path(app, pagename):
    """The page's source as a path inside the repository, or None for a page the build generates."""
    scripts, folders = _generated_sources(app)
    # docs/ sits at the top of the checkout.
    top = Path(app.confdir).resolve().parent
    if pagename in scripts:
        return scripts[pagename].relative_to(top).as_posix()
    if pagename not in app.env.all_docs or any(pagename.startswith(f"{folder}/") for folder in folders):
        return None
    source = Path(app.env.doc2path(pagename)).resolve()
    if source.name == "sg_execution_times.rst":
        return None
    return source.relative_to(top).as_posix()


def _add_source_links(app, pagename, templatename, context, doctree):
    path = source_path(app, pagename)
    if path:
        base, branch = repository_url(app.config), app.config.repository_branch
        context["repository_source"] = {"view": f"{base}/blob/{branch}/{path}",
                                        "edit": f"{base}/edit/{branch}/{path}"}


class RepositoryCode(CodeBlock):
    def run(self):
        config = self.env.config
        values = {"repository_url": repository_url(config), "repository_name": config.repository.split("/")[1]}

        def substitute(found):
            if found.group(1) not in values:
                raise self.error(f"unknown name {found.group(1)!r}: this directive knows {', '.join(values)}")
            return values[found.group(1)]

        self.content = StringList([re.sub(r"\{\{\s*(\w+)\s*\}\}", substitute, line) for line in self.content],
                                  items=self.content.items)
        return super().run()


def setup(app):
    app.add_config_value("repository", "", "html", types=[str])
    app.add_config_value("repository_branch", "main", "html", types=[str])
    app.connect("config-inited", _check)
    app.connect("html-page-context", _add_source_links)
    app.add_directive("repository-code", RepositoryCode)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
