"""The README's and the docs' Python blocks run as written, against a daemon on the config they
name (`<!-- runs against configs/X.yaml -->` on the line before the block): a new user copies
them first. Every ```python block names its config, so a new one cannot go untried."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
MARK = re.compile(r"<!-- runs against (configs/[\w.-]+\.yaml) -->")
BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)


def python_blocks() -> list[tuple[str, str, str]]:
    """(where, config, code) for every ```python block of README.md and docs/*.md."""
    found = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for block in BLOCK.finditer(text):
            line = text.count("\n", 0, block.start()) + 1
            before = text[:block.start()].rstrip("\n").rpartition("\n")[2]
            mark = MARK.fullmatch(before.strip())
            where = f"{path.relative_to(ROOT)}:{line}"
            found.append((where, mark.group(1) if mark else "", block.group(1)))
    return found


def test_every_python_block_names_its_config() -> None:
    blocks = python_blocks()
    assert len(blocks) >= 3
    unnamed = [where for where, config, _ in blocks if not config]
    assert not unnamed, f"add '<!-- runs against configs/....yaml -->' before {unnamed}"
    for where, config, _ in blocks:
        assert (ROOT / config).is_file(), f"{where} names {config}, which is not there"


def test_python_blocks_run_as_written(make_daemon, tmp_path: Path) -> None:
    """Each block in a namespace of its own (what it uses it imports), in the order the docs
    give them, in one interpreter (torch and transformers imported once, not once a block or
    a config), against a daemon for the config it names (`CUVIL_TARGET` set to it), with the
    devices and engine of that config, but for what keeps the suite short: where the config
    lets every runtime build, OpenVINO's and torch's (the one that keeps a language model's
    state), OpenMP waits passive, decode steps not compiled."""
    targets = {}
    for config in sorted({c for _, c, _ in python_blocks() if c}):
        named = yaml.safe_load((ROOT / config).read_text())
        engine = {}
        if "engine" in named:
            given = named["engine"]
            engine = {"engine": {
                **given, "runtimes": given.get("runtimes") or DOCS_RUNTIMES,
                "omp_wait": "passive",
                "sequences": {**given.get("sequences", {}), "compile_steps": False}}}
        cache = tmp_path / f"cache-{len(targets)}"
        targets[config] = make_daemon(devices=named["devices"], cache_dir=str(cache),
                                      **engine).target
    blocks = [(where, targets[config], code) for where, config, code in python_blocks()
              if config]
    done = subprocess.run([sys.executable, "-c", RUN_BLOCKS, json.dumps(blocks)], cwd=tmp_path,
                          env=os.environ, capture_output=True, text=True, timeout=600)
    print(done.stdout)
    assert done.returncode == 0, done.stderr[-3000:]


DOCS_RUNTIMES = {"cpu": ["openvino", "torch"], "npu": ["openvino", "torch"]}
# each block as its own __main__ module's code, its failure naming it
RUN_BLOCKS = """
import json, os, sys, time, traceback
for where, target, code in json.loads(sys.argv[1]):
    os.environ["CUVIL_TARGET"] = target
    start = time.monotonic()
    try:
        exec(compile(code, where, "exec"), {"__name__": "__main__"})
    except BaseException:
        sys.exit(f"{where} failed:\\n{traceback.format_exc()}")
    print(f"--- {where}: {time.monotonic() - start:.1f} s", flush=True)
"""
