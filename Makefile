# distlab: two commands for a newcomer.
#   make lab    create .venv, install distlab with the lesson extras, open JupyterLab on notebooks/
#   make test   create .venv, install distlab with the test extras, lint, run the whole suite (pytest + strict nbval)
#
# TORCH picks the PyTorch build. The default is the CPU build this project is developed on; for a GPU
# machine pass the CUDA build you want, e.g.  make lab TORCH="torch==2.13.0 --index-url <your CUDA wheel index>"

PYTHON ?= python3
# extra JupyterLab arguments, e.g.  make lab LAB_ARGS="--no-browser --port=8890"
LAB_ARGS ?=
# Jupyter refuses to run as root unless told; on a fresh root machine (a container, a cloud VM) say so
ROOT_ARGS := $(if $(filter 0,$(shell id -u)),--allow-root,)
VENV   ?= .venv
TORCH  ?= torch==2.13.0
BIN     = $(VENV)/bin
STAMP   = $(VENV)/.installed

.PHONY: lab test test-fast lint notebooks student bench browser clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH)
	$(BIN)/python -m pip install --quiet -e ".[lab,test]"
	touch $(STAMP)

lab: $(STAMP)
	$(BIN)/jupyter lab --notebook-dir=notebooks $(ROOT_ARGS) $(LAB_ARGS)

test: $(STAMP) lint
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest --nbval tests notebooks

# ruff (pyproject.toml: line length 110); part of `make test`, so CI lints too.
lint: $(STAMP)
	$(BIN)/ruff check .

test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest tests -x -q

# Re-execute every lesson in place (after changing a lesson's source in notebooks/src/).
notebooks: $(STAMP)
	for f in notebooks/src/build_*.py; do $(BIN)/python $$f || exit 1; done
	for nb in notebooks/[0-9]*.ipynb; do \
	  $(BIN)/jupyter nbconvert --to notebook --execute --inplace $$nb || exit 1; done

# The student version of the lessons: solutions stripped (nbgrader markup), checks kept, in student/.
student: $(STAMP)
	$(BIN)/python -m distlab.exercises.student notebooks student

# A real browser: JupyterLab in headless Chromium runs lesson 07 and moves a widget (needs apt: root or sudo).
browser: $(STAMP)
	tests/browser/install_browser.sh $(VENV)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -m browser tests/browser -q

bench: $(STAMP)
	for b in launch_latency allreduce data_parallel tensor_parallel pipeline checkpoint fsdp \
	         all_to_all context_parallel expert_parallel; do \
	  OMP_NUM_THREADS=1 $(BIN)/python benchmarks/$$b.py || exit 1; done
	$(BIN)/python benchmarks/summary.py --readme

clean:
	rm -rf $(VENV) .pytest_cache
