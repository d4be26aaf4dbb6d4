# distlab: two commands for a newcomer.
#   make lab    create .venv, install distlab with the lesson and test extras, write the learner's copy lab/
#               (lab/student: exercises to write, lab/solved: the teacher's versions) and open JupyterLab there
#   make test   create .venv, install distlab with the test extras, lint, run the whole suite (pytest + strict nbval)
#
# TORCH picks the PyTorch build. By default: on a machine with NVIDIA GPUs (nvidia-smi found), PyPI's default
# wheel (the CUDA build); without, the CPU build from PyTorch's CPU index, a few hundred MB instead of several GB,
# when that index answers within 3 s (else PyPI's default, as on machines whose pip config already provides a
# CPU wheel). Override with any pip arguments, e.g.
#   make lab TORCH="torch==2.13.0 --index-url <the CUDA wheel index for your driver>"
# The install says which build it chose and why before it starts, and pip shows its progress.

PYTHON ?= python3
# extra JupyterLab arguments, e.g.  make lab LAB_ARGS="--no-browser --port=8890"
LAB_ARGS ?=
# Jupyter refuses to run as root unless told; on a fresh root machine (a container, a cloud VM) say so
ROOT_ARGS := $(if $(filter 0,$(shell id -u)),--allow-root,)
VENV   ?= .venv
TORCH_VERSION ?= 2.13.0
CPU_INDEX ?= https://download.pytorch.org/whl/cpu
NVIDIA_SMI ?= nvidia-smi
ifeq ($(origin TORCH), undefined)
TORCH_BUILD := $(shell if command -v $(NVIDIA_SMI) >/dev/null 2>&1; then echo cuda; \
	elif $(PYTHON) -c "import urllib.request as u; u.urlopen('$(CPU_INDEX)/torch/', timeout=3)" 2>/dev/null; \
	then echo cpu; else echo no-cpu-index; fi)
TORCH := torch==$(TORCH_VERSION)$(if $(filter cpu,$(TORCH_BUILD)), --index-url $(CPU_INDEX) --extra-index-url \
	https://pypi.org/simple)
else
TORCH_BUILD := given
endif
# what the install says before it starts, and why (a CUDA build is several GB and minutes of download)
TORCH_WHY_cuda = PyPI's default wheel, the CUDA build (nvidia-smi found: NVIDIA GPUs; several GB)
TORCH_WHY_cpu = the CPU build from $(CPU_INDEX) (no nvidia-smi: no NVIDIA GPU; a few hundred MB)
TORCH_WHY_no-cpu-index = PyPI's default wheel (no nvidia-smi, but $(CPU_INDEX) did not answer within 3 s). \
	On Linux that is the CUDA build, several GB, unless your pip configuration points at a CPU index; \
	for the CPU build press Ctrl-C, then: make $(or $(MAKECMDGOALS),lab) \
	TORCH=\"torch==$(TORCH_VERSION) --index-url $(CPU_INDEX)\"
TORCH_WHY_given = TORCH=\"$(TORCH)\", as given
BIN     = $(VENV)/bin
# Lessons store their outputs and nbval compares them digit for digit, so the arithmetic must not depend on the
# CPU: MKL picks its kernels by processor (an AMD EPYC and an Intel Xeon round a matmul differently, and a loss
# printed to 6 digits then differs), unless told to take one code path that every processor with it runs alike
# (MKL's "conditional numerical reproducibility", the AVX2 branch: every x86-64 of the last decade has AVX2, and
# it is the path MKL already takes on AMD processors); torch's own vectorised kernels (sums, softmax, layer norm)
# group their additions by vector width, so they are pinned to AVX2 too.
# One thread per process for the same reason. Lessons are executed (`make notebooks`) and checked (`make test`)
# under the same setting.
REPRODUCIBLE = OMP_NUM_THREADS=1 MKL_CBWR=AVX2 ATEN_CPU_CAPABILITY=avx2
STAMP   = $(VENV)/.installed

.PHONY: lab lab-solved test test-slow test-fast lint notebooks sources student bench browser clean gpu-check

# The lessons' kernels: JupyterLab provisions CurveZMQ keys for each kernel it starts (jupyter_client's
# transport_encryption=auto, for kernels that declare support, as ipykernel's does), so the kernel's messages
# are encrypted and it no longer warns at every start that it runs "over TCP without encryption". Written only
# where this pyzmq has CurveZMQ and this jupyter_client the option (else JupyterLab would refuse the setting),
# into the venv's own Jupyter config (etc/jupyter, read by the venv's JupyterLab), not over one already there.
KERNEL_CONFIG = jupyter-config/jupyter_server_config.json

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	@echo "distlab: installing PyTorch: $(TORCH_WHY_$(TORCH_BUILD))"
	$(BIN)/python -m pip install --progress-bar on $(TORCH)
	@echo "distlab: installing distlab with the lesson and test extras (.[lab,test]) into $(VENV)"
	$(BIN)/python -m pip install --progress-bar on -e ".[lab,test]"
	if $(BIN)/python -c "import sys, zmq, jupyter_client as j; \
	    sys.exit(not (zmq.has('curve') and 'transport_encryption' in j.KernelManager.class_traits()))"; \
	then mkdir -p $(VENV)/etc/jupyter && cp -n $(KERNEL_CONFIG) $(VENV)/etc/jupyter/; fi
	touch $(STAMP)

# The learner's working copy, ignored by git (.gitignore), so that JupyterLab's autosave, outputs and edited
# exercises never touch a tracked file: lab/student (every lesson, each exercise's solution a stub: work here),
# lab/solved (the teacher's versions: compare here), lab/distlab (a link to the package: the code the lessons
# link). Re-running `make lab` writes what is missing and refreshes what the learner has not changed; a copy the
# learner changed is kept (`$(BIN)/python -m distlab.lessons lab --force` replaces those too). The kernel imports
# distlab from this checkout (the editable install). LAB_DIR picks another folder.
LAB_DIR ?= lab
lab: $(STAMP)
	$(BIN)/python -m distlab.lessons $(LAB_DIR)
	$(BIN)/jupyter lab --notebook-dir=$(LAB_DIR) $(ROOT_ARGS) $(LAB_ARGS)

# A teacher (or an author editing lessons) opens the tracked, solved lessons themselves: autosave writes into them.
lab-solved: $(STAMP)
	$(BIN)/jupyter lab --notebook-dir=notebooks $(ROOT_ARGS) $(LAB_ARGS)

# `make test` leaves out the tests marked slow (spawn and forkserver variants, larger worlds: a few minutes
# more); `make test-slow` runs exactly those. CI (.ci/run) runs both.
test: $(STAMP) lint
	$(REPRODUCIBLE) $(BIN)/python -m pytest --nbval -m "not slow" --durations=15 tests notebooks

test-slow: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -m slow tests

# ruff (pyproject.toml: line length 110); part of `make test`, so CI lints too.
lint: $(STAMP)
	$(BIN)/ruff check .

test-fast: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest tests -x -q

# A lesson is a pair (notebooks/jupytext.toml): NN_name.py, its source in jupytext's percent format, and
# NN_name.ipynb, the same cells executed. After editing .py files: `make notebooks` copies each one's cells
# into its .ipynb (jupytext --update: outputs and cell ids kept) and re-executes the lesson in place.
# LESSONS picks some:  make notebooks LESSONS=notebooks/03_zero.py
LESSONS ?= notebooks/[0-9]*.py
notebooks: $(STAMP)
	for py in $(LESSONS); do \
	  $(BIN)/jupytext --quiet --update --to ipynb $$py || exit 1; \
	  $(REPRODUCIBLE) $(BIN)/jupyter nbconvert --to notebook --execute --inplace $${py%.py}.ipynb || exit 1; done

# The other way, .ipynb -> .py: a lesson that arrived as a notebook only (or was edited in Jupyter without
# jupytext) gets its source written from its cells.  make sources NOTEBOOKS=notebooks/12_*.ipynb
NOTEBOOKS ?= notebooks/[0-9]*.ipynb
sources: $(STAMP)
	$(BIN)/jupytext --to py:percent $(NOTEBOOKS)

# The student version of the lessons: solutions stripped (nbgrader markup), checks kept, in student/.
student: $(STAMP)
	$(BIN)/python -m distlab.exercises.student notebooks student

# A real browser: JupyterLab in headless Chromium runs lesson 07 and moves a widget (needs apt: root or sudo).
browser: $(STAMP)
	tests/browser/install_browser.sh $(VENV)
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -m browser tests/browser -q

bench: $(STAMP)
	for b in launch_latency allreduce data_parallel tensor_parallel pipeline checkpoint fsdp \
	         all_to_all context_parallel expert_parallel talk_less; do \
	  OMP_NUM_THREADS=1 $(BIN)/python benchmarks/$$b.py || exit 1; done
	$(BIN)/python benchmarks/summary.py --readme

clean:
	rm -rf $(VENV) .pytest_cache

# Every GPU figure the project lacks, in one command of under 8 minutes on one GPU (benchmarks/gpu_check.py:
# the gpu-marked tests, the memory ledger beside CUDA's allocator, bf16 step time and MFU, the collective
# benchmarks on CUDA tensors; results in benchmarks/results/gpu/ and README's GPU table). It installs nothing
# (a lent GPU machine has no internet): it runs in the .venv that `make test` made (torch with CUDA, the test
# extra), order-only, so an existing .venv is used as it is. The same script on a CPU in seconds:
#   python benchmarks/gpu_check.py --dry
GPU_CHECK_ARGS ?=
gpu-check: | $(STAMP)
	$(BIN)/python benchmarks/gpu_check.py $(GPU_CHECK_ARGS)
