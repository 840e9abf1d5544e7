"""The one entry point: tests, lint, docs, build, bench, demo.

Every session installs what it needs, so a fresh machine with Python 3.11 and pip needs
only `python3 -m pip install nox uv` first (uv is optional: without it nox uses virtualenv).
"""

from __future__ import annotations

import glob
import os
import pathlib
import re
import shutil
import sys

import nox

ROOT = pathlib.Path(__file__).parent
PACKAGES = sorted(p.name for p in (ROOT / "packages").iterdir() if (p / "pyproject.toml").exists())
PYTHON = "3.11"
# what tests/integration, tests/compat (the peers, to compare with) and examples/ need beyond the packages' own test extras
INTEGRATION_DEPS = ("matplotlib", "grain>=0.2", "flax>=0.12", "orbax-checkpoint>=0.12")

# uv creates venvs and installs in seconds where it is on PATH (`pip install uv`); else virtualenv + pip
nox.options.default_venv_backend = "uv|virtualenv"
nox.options.reuse_existing_virtualenvs = True
nox.options.sessions = ["tests"]
# Only Python 3.11 is asked for (the one interpreter on our machines). If it is missing,
# fail: a skipped session would let the test command pass without running a test.
nox.options.error_on_missing_interpreters = True


def _editable_all(session: nox.Session, extras: str = "test", only: tuple[str, ...] | None = None) -> None:
    """Install every package (or those in ``only``) editable with its extras, in dependency order (core first)."""
    order = ["core_array"] + [p for p in PACKAGES if p != "core_array" and (only is None or p in only)]
    args = []
    for pkg in order:
        pyproject = (ROOT / "packages" / pkg / "pyproject.toml").read_text()
        wanted = [e for e in extras.split(",") if f"\n{e} = [" in pyproject or f"\n{e}=[" in pyproject]
        spec = f"packages/{pkg}" + (f"[{','.join(wanted)}]" if wanted else "")
        args += ["-e", spec]
    session.install(*args)


def _cairn_dependencies(package: str) -> list[str]:
    """The Cairn packages ``package``'s pyproject requires (extras excluded), as folder names."""
    import tomllib

    meta = tomllib.loads((ROOT / "packages" / package / "pyproject.toml").read_text())
    deps = []
    for dep in meta["project"].get("dependencies", []):
        name = dep.split(";")[0].strip()
        for sep in "<>=!~[ ":
            name = name.split(sep)[0]
        if name.lower().startswith("cairn-"):
            deps.append(name[len("cairn-"):].replace("-", "_"))
    return deps


def _cairn_closure(packages: list[str]) -> list[str]:
    """``packages`` and every Cairn package they require, directly or not (folder names, sorted)."""
    seen: set[str] = set()
    todo = list(packages)
    while todo:
        pkg = todo.pop()
        if pkg not in seen:
            seen.add(pkg)
            todo += _cairn_dependencies(pkg)
    return sorted(seen)


def _xdist_workers() -> str:
    return os.environ.get("CAIRN_TEST_WORKERS", "auto")


def _test_env() -> dict[str, str]:
    """The test sessions' environment: XLA at backend optimization level 0.

    The tests' arrays are tiny, so XLA compiling each function costs far more than running
    it: skipping LLVM's optimization passes made tests/optim 25% faster on 2 CPU cores
    (125 -> 94 s) with every result unchanged in kind (the same operations, less
    optimised machine code). Benchmarks and the demo keep XLA's defaults. Appends to a
    caller's ``XLA_FLAGS``.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    return {"XLA_FLAGS": f"{flags} --xla_backend_optimization_level=0".strip()}


@nox.session(python=PYTHON)
def tests(session: nox.Session) -> None:
    """The default suite: every package, tests/integration and the packages' doctests, one
    venv, one pytest-xdist run.

    Slow cases (`@pytest.mark.slow`) run in `tests_slow`. pytest's exit code 5 (no tests
    collected) fails the session like any other failure. Without arguments it then runs every
    package's README examples in a fresh venv holding only that package's wheel and what its
    install line names (two packages at a time), as `readme_examples` does.
    """
    _editable_all(session, "test,parquet,arrayrecord,safetensors")
    session.install("pytest", "pytest-xdist", "hypothesis", *INTEGRATION_DEPS)
    # one run for the tests and the packages' doctests (one start-up and collection, one
    # xdist pool); tests/conftest.py keeps helper modules under tests/ out of the doctests
    targets = session.posargs or ["--doctest-modules", "tests", *sorted(glob.glob("packages/*/src/cairn"))]
    session.run(
        "python", "-m", "pytest", "-n", _xdist_workers(), "--dist", "loadgroup",
        "-m", "not slow", "-p", "no:cacheprovider", "--durations=15", *targets, env=_test_env(),
    )
    if not session.posargs:  # the whole suite: every README's examples, each package in a fresh venv
        _run_readme_examples(session, PACKAGES, workers=2)


@nox.session(python=PYTHON)
def tests_slow(session: nox.Session) -> None:
    """Only the cases marked slow (long sweeps, many-trial crash tests, multi-process runs)."""
    _editable_all(session, "test,parquet,arrayrecord,safetensors")
    session.install("pytest", "pytest-xdist", "hypothesis", *INTEGRATION_DEPS)
    session.run("python", "-m", "pytest", "-n", _xdist_workers(), "--dist", "loadgroup", "-m", "slow",
                *(session.posargs or ["tests"]), env=_test_env())


@nox.session(python=PYTHON)
@nox.parametrize("package", PACKAGES)
def tests_package(session: nox.Session, package: str) -> None:
    """One package alone: installs only it and its declared dependencies, runs its tests.

    Proves each distribution stands on its own (cairn.data runs here without JAX).
    """
    session.install("-e", "packages/core_array")
    if package != "core_array":
        # the application layer (llm) depends on sibling libraries: from this tree, not an index
        siblings = [f"packages/{p}" for p in _cairn_dependencies(package) if p != "core_array"]
        session.install(*[a for s in siblings for a in ("-e", s)], "-e", f"packages/{package}[test]")
    else:
        session.install("-e", "packages/core_array[test]")
    session.install("pytest", "pytest-xdist", "hypothesis")
    session.run("python", "tools/check_installed.py", package)
    if package in TESTS_USE_LLM:
        # the tests' model is a cairn.llm CausalLM; installed only after check_installed has
        # proved the library imports and runs without it
        deps = [f"packages/{p}" for p in _cairn_dependencies("llm") if p not in ("core_array", package)]
        session.install(*[a for s in [*deps, "packages/llm"] for a in ("-e", s)])
    session.run(
        "python", "-m", "pytest", "-n", _xdist_workers(), "-m", "not slow", "-p", "no:cacheprovider",
        f"tests/{package}", *session.posargs, env=_test_env(),
    )


# packages whose tests (not the library) build their test models with cairn.llm
# (tests/serving/gen_testlib.py: the generation tests' tiny model is a CausalLM)
TESTS_USE_LLM = ("serving",)


# what the lint steps read besides packages/: the code around the packages
LINT_PATHS = ("packages", "tests", "benchmarks", "examples", "tools", "noxfile.py")


@nox.session(python=PYTHON)
def lint(session: nox.Session) -> None:
    """Every house rule; each step runs even when an earlier one fails, the session fails at the end.

    ruff (config in pyproject: absolute imports only, unused code), the dependency
    direction, no import cycle inside a package and every third-party import declared in the
    package's pyproject (tools/depcheck.py), no function over
    80 lines (tools/funclen.py), type hints on public signatures (tools/typehints.py), an
    ``Args:`` section naming every parameter of each callable in a package's ``__all__``
    (tools/docargs.py, with tools/docargs_todo.txt the shrinking list of those not yet done), one
    banner style (tools/banners.py), dead code (vulture, [tool.vulture], whitelist
    tools/vulture_whitelist.py) and mypy ([tool.mypy]) over packages/*/src, with the
    packages installed so jax/numpy types resolve.
    """
    session.install("ruff", "vulture", "mypy")
    _editable_all(session, "")  # the packages and their required dependencies, for mypy
    srcs = sorted(glob.glob("packages/*/src"))
    steps = [
        ("ruff", "check", *LINT_PATHS),
        ("python", "tools/depcheck.py", "packages"),
        ("python", "tools/funclen.py", "packages", "examples", "tools", "benchmarks"),
        ("python", "tools/typehints.py", "packages", "examples", "tools", "benchmarks"),
        ("python", "tools/docargs.py"),  # imports the packages: their __all__ is what users see
        ("python", "tools/banners.py", *LINT_PATHS),
        ("vulture",),  # paths, confidence and ignored names: [tool.vulture] in pyproject.toml
        ("mypy", *srcs),
    ]
    failed = []
    for step in steps:
        try:
            session.run(*step, env={"MYPYPATH": os.pathsep.join(srcs)})
        except nox.command.CommandFailed:
            failed.append(" ".join(step))
    if failed:
        session.error("lint steps failed: " + "; ".join(failed))


@nox.session(python=PYTHON)
def build(session: nox.Session) -> None:
    """A wheel per package into dist/, each installed alone into a fresh venv and imported."""
    session.install("pip")  # wheels come from `pip wheel --no-deps`; each is checked in a fresh venv
    dist = ROOT / "dist"
    dist.mkdir(exist_ok=True)
    for old in dist.glob("*.whl"):
        old.unlink()
    for pkg in PACKAGES:
        session.run("python", "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), f"packages/{pkg}")
    tmp = pathlib.Path(session.create_tmp()).resolve()
    core_wheel = next(dist.glob("cairn_core_array-*.whl"))
    for pkg in PACKAGES:
        wheel = next(dist.glob(f"cairn_{pkg}-*.whl"))
        venv = tmp / f"venv-{pkg}"
        session.run(sys.executable, "-m", "venv", "--clear", str(venv), external=True)
        py = str(venv / "bin" / "python")
        wheels = [str(core_wheel)] + ([] if pkg == "core_array" else [str(wheel)])
        session.run(py, "-m", "pip", "install", "-q", "--find-links", str(dist), *wheels, external=True)
        session.run(py, str(ROOT / "tools" / "check_installed.py"), pkg, "--wheel", external=True)


# Where the README contract runs (issue 31: "CI runs it, or tests_package does it"): at the
# end of `nox -s tests` (CI's command), all packages two at a time, after the pytest run;
# `nox -s readme_examples` runs one package (or all) alone. The suite also holds the fast
# static half, tests/tooling/test_tooling_readme_examples.py (every module a README example
# imports comes from the package, a dependency or the install line), and tools/depcheck.py's
# declared-dependency contract.
@nox.session(python=PYTHON)
@nox.parametrize("package", PACKAGES)
def readme_examples(session: nox.Session, package: str) -> None:
    """A package's README examples, run in a fresh venv holding only its wheel (with the Cairn
    wheels it depends on, built from this tree) and what the README's install line names.

    The install line is the first `pip install` under the README's `## Install` heading
    (tools/run_doc_examples.py reads it): `pip install "cairn-data[parquet]"` installs the
    cairn-data wheel with its parquet extra; `pip install cairn-nn optax` adds Optax from
    the index. So a README example that needs something its install line does not say fails.
    """
    _run_readme_examples(session, [package], workers=1)


def _run_readme_examples(session: nox.Session, packages: list[str], workers: int) -> None:
    """Build every Cairn wheel once, then per package a fresh venv and its README's examples,
    ``workers`` packages at a time; the session fails naming each package that failed."""
    import concurrent.futures
    import subprocess
    import time

    sys.path.insert(0, str(ROOT / "tools"))
    import run_doc_examples

    tmp = pathlib.Path(session.create_tmp()).resolve() / "readme"
    shutil.rmtree(tmp, ignore_errors=True)
    dist = tmp / "dist"
    session.install("pip")  # wheels come from `pip wheel --no-deps`
    named = [_cairn_named(run_doc_examples.install_line(ROOT / "packages" / p / "README.md")) for p in packages]
    session.run("python", "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist),
                *[f"packages/{p}" for p in _cairn_closure([*packages, *sum(named, [])])])
    base = str(pathlib.Path(session.bin) / "python")

    def one(package: str) -> tuple[str, int, str, float]:
        t0 = time.perf_counter()
        readme = ROOT / "packages" / package / "README.md"
        venv = tmp / f"venv-{package}"
        py = str(venv / "bin" / "python")
        reqs = _readme_requirements(run_doc_examples.install_line(readme), package, dist)
        if shutil.which("uv"):  # hard links from uv's cache: seconds
            steps = [["uv", "venv", "-q", "--python", base, str(venv)], ["uv", "pip", "install", "-q", "--python", py, *reqs]]
        else:
            steps = [[base, "-m", "venv", "--clear", str(venv)], [py, "-m", "pip", "install", "-q", *reqs]]
        out = ""
        # the examples: compiled at XLA's level 0 as in the tests (compiling dominates), and every
        # cache they could write under the user's home pointed into this run's folder (as
        # tests/conftest.py does); the installs keep uv's own cache
        cache = tmp / f"cache-{package}"
        run_env = {**os.environ, **_test_env(), **{v: str(cache / v.lower()) for v in (
            "CAIRN_KERNELS_CACHE_DIR", "CAIRN_CACHE_DIR", "XDG_CACHE_HOME", "MPLCONFIGDIR", "HF_HOME")}}
        examples = [py, str(ROOT / "tools" / "run_doc_examples.py"), "--python", py, str(readme)]
        for cmd in [*steps, examples]:
            r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT,
                               env=run_env if cmd is examples else None)
            out += r.stdout + r.stderr
            if r.returncode:
                return package, r.returncode, out, time.perf_counter() - t0
        return package, 0, out, time.perf_counter() - t0

    with concurrent.futures.ThreadPoolExecutor(workers) as pool:
        results = list(pool.map(one, packages))
    for package, rc, out, took in results:
        session.log(f"README examples of {package}: {'ok' if rc == 0 else 'FAILED'} ({took:.0f} s)")
        for line in out.splitlines():
            if line.startswith(str(ROOT)):  # one line per example: where, status, seconds
                session.log(f"  {os.path.relpath(line, ROOT)}")
        if rc:
            print(out[-6000:])
    failed = [p for p, rc, _, _ in results if rc]
    if failed:
        session.error(f"README examples failed in a fresh venv for: {', '.join(failed)}")


def _cairn_named(wanted: list[str]) -> list[str]:
    """The Cairn packages (folder names) an install line's requirements name."""
    return [m.group(1)[len("cairn-"):].replace("-", "_") for w in wanted
            if (m := re.match(r"(cairn-[a-z0-9-]+)", w.lower()))]


def _readme_requirements(wanted: list[str], package: str, dist: pathlib.Path) -> list[str]:
    """What a fresh venv installs for ``package``'s README: its install line, with every Cairn
    distribution (named there or needed by one) by direct reference to this tree's wheel in
    ``dist`` (never an index's), the extras the line asks for kept."""
    needed = _cairn_closure([package, *_cairn_named(wanted)])
    wheels = {pkg: next(dist.glob(f"cairn_{pkg}-*.whl")) for pkg in needed}
    reqs, given = [], set()
    for w in wanted:
        m = re.match(r"(cairn-[a-z0-9-]+)(\[[^\]]*\])?", w.lower())
        if m is None:
            reqs.append(w)
            continue
        pkg = m.group(1)[len("cairn-"):].replace("-", "_")
        given.add(pkg)
        reqs.append(f"{m.group(1)}{m.group(2) or ''} @ {wheels[pkg].as_uri()}")
    return reqs + [f"cairn-{p.replace('_', '-')} @ {wheels[p].as_uri()}" for p in needed if p not in given]


@nox.session(default=False, python=PYTHON)
def fixtures_hf(session: nox.Session) -> None:
    """Rewrites the committed Hugging Face fixtures of tests/llm and tests/serving (not in CI, not a default session).

    A venv with torch (exactly 2.13.0, the local CPU wheel; never a CUDA build) and transformers runs
    tests/llm/fixtures/make_fixtures.py (tiny random checkpoints of every family with
    transformers' logits), tests/serving/fixtures/make_tokenizer_fixtures.py, and make_peft_fixtures.py
    (peft LoRA adapters on those models, with peft's logits); then check_transformers_loads.py
    saves every fixture again with cairn.llm and checks that transformers loads it with the
    same logits. Commit the result.
    """
    # pinned exactly: the CPU wheel of this version is the one pip finds (find-links); a loose
    # pin would let the resolver pick a newer CUDA build from the index
    session.install("torch==2.13.0", "transformers>=5", "safetensors>=0.4", "tokenizers>=0.19", "jinja2>=3.1", "numpy")
    session.install("-e", "packages/core_array")
    session.install(*[a for p in _cairn_dependencies("llm") if p != "core_array" for a in ("-e", f"packages/{p}")],
                    "-e", "packages/llm")
    session.run("python", "tests/llm/fixtures/make_fixtures.py", *session.posargs)
    # the tokenizer folders live with cairn.serving, whose Tokenizer cairn.llm re-exports
    session.run("python", "tests/serving/fixtures/make_tokenizer_fixtures.py")
    # LoRA adapters written by peft itself on the fixture models (tests/llm/test_llm_lora.py)
    session.install("peft>=0.17")
    session.run("python", "tests/llm/fixtures/make_peft_fixtures.py")
    session.run("python", "tests/llm/fixtures/check_transformers_loads.py", *session.posargs)


@nox.session(default=False, python=PYTHON)
def compat_suites(session: nox.Session) -> None:
    """The peers' own test files run against Cairn (not in CI, not a default session).

    tools/compat_suites.py runs Grain's and Optax's test files straight from their
    installed wheels, once on the peer and once with the peer's imports pointed at Cairn,
    and prints per-file and total pass rates among the tests that pass on the peer and use
    only its public API (private-internals tests counted apart). Arguments after `--` go to
    the script, one peer per run, e.g. `nox -s compat_suites -- grain --files slice_test.py`
    or, for Flax NNX / Orbax (no tests in their wheels), `-- flax --peer-tests <clone>/tests/nnx`
    or `-- orbax --peer-tests <clone>/checkpoint/orbax/checkpoint` (Orbax's default files are
    listed in the script; docs/checkpoint.md has the rates).
    With no arguments: Grain, then Optax, with their default files.
    """
    _editable_all(session, "test,parquet,arrayrecord,safetensors")
    # the versions the rates in docs/data.md and docs/checkpoint.md were measured against;
    # chex and portpicker: imported by Orbax's test files and their multiprocess helper
    session.install("pytest", "absl-py", "cloudpickle", *INTEGRATION_DEPS, "grain==0.2.18", "optax==0.2.8",
                    "orbax-checkpoint==0.12.8", "chex", "portpicker")
    runs = [session.posargs] if session.posargs else [["grain"], ["optax"]]
    for args in runs:
        session.run("python", "tools/compat_suites.py", *args)


# what the docs site needs, in the docs session only (never a library dependency): mkdocstrings'
# Python handler reads the docstrings (Google style) for the API reference pages, pymdown's
# highlight colours code with pygments at build time (no highlight.js from a CDN)
DOCS_DEPS = ("mkdocs>=1.6", "mkdocstrings[python]>=0.26", "pymdown-extensions>=10", "pygments>=2.17")


@nox.session(python=PYTHON)
def docs(session: nox.Session) -> None:
    """Runs every ```python example in docs/ and the package READMEs, then builds the site into build/docs.

    `mkdocs build --strict`: a warning fails the build (a broken link, a page missing from
    the navigation, a docstring `Args:` entry mkdocstrings cannot match to a parameter).
    tools/md_docstrings.py (a Markdown extension, found on PYTHONPATH=tools) renders the
    docstrings' doctests as code; tools/check_site_offline.py then checks that no page loads
    anything from the network and that the code is highlighted.
    """
    _editable_all(session, "test,parquet,arrayrecord,safetensors")
    session.install(*DOCS_DEPS)
    session.run("python", "tools/run_doc_examples.py", "docs", *[f"packages/{p}/README.md" for p in PACKAGES])
    session.run("python", "-m", "mkdocs", "build", "--strict", "--quiet", "--site-dir", "build/docs",
                env={"PYTHONPATH": str(ROOT / "tools")})
    session.run("python", "tools/check_site_offline.py", "build/docs")


@nox.session(python=PYTHON)
def demo(session: nox.Session) -> None:
    """The main job: the reference LM recipe (examples/lm) with its default config.

    Extra arguments go to the script, e.g. `nox -s demo -- --set train.steps=200` or
    `nox -s demo -- --resume`. A run directory that already holds checkpoints (without
    `-- --resume` or `-- --overwrite`) or a bad config stops the session before anything
    is installed (`demo_preflight`).
    """
    refusal = demo_preflight(session.posargs)
    if refusal is not None:
        session.error(refusal)
    _editable_all(session, "parquet,arrayrecord", only=DEMO_PACKAGES)
    session.install(*DEMO_DEPS)
    # the script's advice then reads as typed here: `nox -s demo -- --resume`
    session.run("python", "examples/lm/train.py", *session.posargs, env={"CAIRN_LM_COMMAND": DEMO_COMMAND})


DEMO_COMMAND = "nox -s demo --"
# what examples/lm imports (tests/tooling/test_tooling_contract.py checks it against the
# recipe's imports): the libraries and cairn.llm (its model), and no peer library (flax, grain, orbax)
DEMO_PACKAGES = ("core_array", "data", "nn", "optim", "kernels", "checkpoint", "quant", "serving", "llm")
# matplotlib: the report's plots; tritonclient: the main job checks the served /infer model
# with Triton's own client; openai: it asks the served model through OpenAI's own client
# (chat completions, streamed and not). The demo's dependencies, never the libraries'.
DEMO_DEPS = ("matplotlib", "tritonclient[http]>=2.40", "openai>=1.50")


def demo_preflight(posargs: list[str]) -> str | None:
    """What `train.py` would stop with at once for these arguments (run directory already in
    use, contradictory flags, bad config), asked before the demo installs anything: the
    message, with its advice written for `nox -s demo -- ...`, or None to go on.

    examples/lm/lm_cli.py resolves the run directory as train.py does (config file, then
    `--set`) with the standard library only, so nothing needs installing for it.
    """
    lm = str(ROOT / "examples" / "lm")
    if lm not in sys.path:
        sys.path.insert(0, lm)
    try:
        import lm_cli  # needs tomllib (Python 3.11), like the recipe itself
    except ImportError:
        return None  # train.py makes the same check, after the installs
    return lm_cli.preflight(list(posargs), cmd=DEMO_COMMAND)


@nox.session(python=PYTHON)
def bench(session: nox.Session) -> None:
    """Runs every script in benchmarks/ against the peer libraries (`-- --full` for full sizes)."""
    _editable_all(session, "test,bench,parquet,arrayrecord,safetensors")
    full = "--full" in session.posargs
    for script in sorted((ROOT / "benchmarks").glob("*.py")):
        if script.name.startswith("_"):
            continue
        session.run("python", str(script), *([] if full else ["--quick"]))


# the peer of benchmarks/posttrain.py, at the versions it was measured with (google-tunix 0.1.7
# runs on jax 0.10.2); installed in this session only, never a dependency of a Cairn package
TUNIX_DEPS = ("google-tunix==0.1.7", "jax==0.10.2", "jaxlib==0.10.2")


@nox.session(default=False, python=PYTHON)
def bench_posttrain(session: nox.Session) -> None:
    """benchmarks/posttrain.py against google-tunix's DPO trainer and GRPO learner (`-- --full` for full sizes).

    `nox -s bench` runs the same script without Tunix installed: it then prints why Tunix did
    not run and compares with the plain JAX loop only.
    """
    _editable_all(session, "test,bench,safetensors")
    session.install(*TUNIX_DEPS)
    session.run("python", "benchmarks/posttrain.py", *([] if "--full" in session.posargs else ["--quick"]))
