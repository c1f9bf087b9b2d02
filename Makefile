# The two commands a fresh clone needs: `make demo` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# torch is pinned to the CPU build on local disk; the GPU machine brings its own torch.
TORCH_PIN := torch==2.13.0

.PHONY: demo test lint clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/v4compile demo

# two workers, a test file each at a time (its module fixtures stay in one process): a single pytest process keeps
# one of the two cores busy, mostly in Inductor's Python code generation. Each keeps torch's two intra-op threads
# (one would change MKL's sums, and a golden folder sits at its band's edge), waiting passively, not spinning.
test: $(STAMP)
	$(PY) -m ruff check .
	OMP_WAIT_POLICY=PASSIVE $(PY) -m pytest -q -n 2 --dist loadfile

lint: $(STAMP)
	$(PY) -m ruff check .

clean:
	rm -rf $(VENV) build *.egg-info
