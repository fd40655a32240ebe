"""The browser client as an npm package: its manifest, ``npm pack``, the
TypeScript declarations checked by ``tsc``, the vendored third-party files,
and the chat page importing exactly this package.

Needs node and npm (deploy/setup.sh --test installs them and runs ``npm ci``
in clients/browser); the tests install the pinned dev dependencies themselves
when node_modules is missing.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import tarfile
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[2] / "clients" / "browser"
NPM = shutil.which("npm")
NODE = shutil.which("node")

pytestmark = [
    pytest.mark.skipif(NPM is None or NODE is None, reason="node/npm not installed"),
    pytest.mark.timeout(300),
]


def manifest() -> dict:  # type: ignore[type-arg]
    return dict(json.loads((PKG / "package.json").read_text()))


def import_map() -> dict[str, str]:
    """The chat page's import map: module name -> URL."""
    html = (PKG / "index.html").read_text()
    found = re.search(r'<script type="importmap">(.*?)</script>', html, re.S)
    assert found is not None
    return dict(json.loads(found[1])["imports"])


def run(*cmd: str, cwd: Path = PKG) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=240)


@pytest.fixture(scope="module")
def node_modules() -> Path:
    """The pinned dev dependencies (package-lock.json), installed once if any is missing
    (a node_modules from before a new pin, e.g. uqr, lacks it)."""
    modules = PKG / "node_modules"
    if not all((modules / dep / "package.json").exists() for dep in manifest()["devDependencies"]):
        done = run(str(NPM), "ci", "--no-audit", "--no-fund")
        assert done.returncode == 0, done.stderr
    return modules


def test_manifest_is_a_publishable_es_module() -> None:
    m = manifest()
    assert m["name"] == "wsinfer-client"
    assert re.fullmatch(r"\d+\.\d+\.\d+", m["version"])
    assert m["type"] == "module" and "private" not in m
    assert m["exports"]["."] == {"types": "./wsinfer.d.ts", "default": "./wsinfer.js"}
    assert m["types"] == "./wsinfer.d.ts" and m["license"] == "Apache-2.0"
    for name in ("wsinfer.js", "wsinfer.d.ts", "contract.js", "README.md", "LICENSE"):
        assert name in m["files"] and (PKG / name).is_file()


def test_npm_pack(tmp_path: Path) -> None:
    done = run(str(NPM), "pack", "--pack-destination", str(tmp_path))
    assert done.returncode == 0, done.stderr
    [tarball] = tmp_path.glob("wsinfer-client-*.tgz")
    with tarfile.open(tarball) as tar:
        names = sorted(tar.getnames())
        packed = tar.extractfile("package/wsinfer.js")
        assert packed is not None and packed.read() == (PKG / "wsinfer.js").read_bytes()
    assert names == [
        f"package/{n}"
        for n in (
            "LICENSE",
            "README.md",
            "contract.d.ts",
            "contract.js",
            "package.json",
            "wsinfer.d.ts",
            "wsinfer.js",
        )
    ]


def test_types_check_with_tsc(node_modules: Path) -> None:
    done = run(str(node_modules / ".bin" / "tsc"), "-p", "tsconfig.json")
    assert done.returncode == 0, done.stdout + done.stderr


def test_tsc_catches_a_misuse(node_modules: Path, tmp_path: Path) -> None:
    """The check has teeth: a wrong option name and a wrong event detail fail it."""
    bad = PKG / "types-test" / "misuse.ts"
    bad.write_text(
        'import { WsinferClient } from "wsinfer-client";\n'
        "const c = new WsinferClient({ storageKye: 'x' });\n"
        'c.generate({ prompt: "a" }).addEventListener("delta", (e) => e.detail.sequence);\n'
    )
    try:
        done = run(
            str(node_modules / ".bin" / "tsc"),
            "--noEmit",
            "--strict",
            "--module",
            "NodeNext",
            "--moduleResolution",
            "NodeNext",
            "--target",
            "ES2022",
            "--lib",
            "ES2022,DOM",
            str(bad),
        )
    finally:
        bad.unlink()
    assert done.returncode != 0
    assert "storageKye" in done.stdout and "sequence" in done.stdout


def test_declarations_cover_the_module_exports(node_modules: Path) -> None:
    exports = run(
        str(NODE),
        "--input-type=module",
        "-e",
        "const m = await import('./wsinfer.js'); console.log(JSON.stringify(Object.keys(m)))",
    )
    assert exports.returncode == 0, exports.stderr
    declared = (PKG / "wsinfer.d.ts").read_text()
    for name in json.loads(exports.stdout):
        if name == "default":
            assert "export default WsinferClient" in declared
        else:
            assert re.search(rf"export declare (const|class) {name}\b", declared), name


def test_vendored_files_are_the_pinned_builds(node_modules: Path) -> None:
    """Every file in vendor/ is listed in vendor.mjs and is, byte for byte, its
    pinned package's build (the check refuses one copied in by hand)."""
    done = run(str(NODE), "vendor.mjs", "--check")
    assert done.returncode == 0, done.stderr
    vendor = {p.name for p in (PKG / "vendor").iterdir()}
    for lib in ("marked", "dompurify", "highlight.js", "uqr"):
        assert f"{lib}.LICENSE" in vendor
    # Each vendored module of the page's import map is one vendor.mjs lists.
    row = r'^\s*\["[^"]+", "[^"]+", "([^"]+)"\],'
    listed = set(re.findall(row, (PKG / "vendor.mjs").read_text(), re.M))
    urls = import_map().values()
    vendored = {u.removeprefix("/static/vendor/") for u in urls if u.startswith("/static/vendor/")}
    assert vendored and vendored <= listed, vendored - listed
    lock = json.loads((PKG / "package-lock.json").read_text())["packages"]
    for dep, version in manifest()["devDependencies"].items():
        assert lock[f"node_modules/{dep}"]["version"] == version  # exact pins


def test_readme_has_the_resume_example() -> None:
    readme = (PKG / "README.md").read_text()
    assert "npm pack" in readme and "npm install /path/to/wsinfer" in readme
    assert 'from "wsinfer-client"' in readme and "restoreTurn()" in readme


def test_chat_page_uses_exactly_the_package() -> None:
    """The page imports the package by its name; the import map resolves that
    name to the package's own entry point, served from /static."""
    imports = import_map()
    entry = manifest()["exports"]["."]["default"].removeprefix("./")
    assert imports["wsinfer-client"] == f"/static/{entry}"
    assert 'from "wsinfer-client"' in (PKG / "chat.js").read_text()
    # Everything else the page loads is ours or vendored: nothing from a CDN.
    for url in imports.values():
        assert url.startswith("/static/") and (PKG / url.removeprefix("/static/")).is_file()
    for js in PKG.glob("*.js"):
        assert "http://" not in js.read_text().replace("http://127.0.0.1", "")


def test_the_packed_tarball_installs_and_bundles_in_an_app(
    node_modules: Path, tmp_path: Path
) -> None:
    """What a browser app does with the package: `npm install` the tarball `npm pack`
    made (no registry involved), import it by name, bundle it (esbuild), type-check it."""
    done = run(str(NPM), "pack", "--pack-destination", str(tmp_path))
    assert done.returncode == 0, done.stderr
    [tarball] = tmp_path.glob("wsinfer-client-*.tgz")
    app = tmp_path / "app"
    app.mkdir()
    (app / "package.json").write_text('{"name": "app", "private": true, "type": "module"}')
    done = run(str(NPM), "install", "--offline", "--no-audit", "--no-fund", str(tarball), cwd=app)
    assert done.returncode == 0, done.stderr
    assert json.loads((app / "package.json").read_text())["dependencies"]["wsinfer-client"]
    (app / "main.ts").write_text(
        'import { WsinferClient } from "wsinfer-client";\n'
        'const client = new WsinferClient({ url: "ws://127.0.0.1:8000/v1/ws" });\n'
        "export const state: string = client.state;\n"
        "export { WsinferClient };\n"
    )
    bundle = app / "bundle.js"
    done = run(
        str(node_modules / ".bin" / "esbuild"), "main.ts", "--bundle", "--format=esm",
        "--platform=browser", f"--outfile={bundle}", cwd=app,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    text = bundle.read_text()
    assert "// node_modules/wsinfer-client/wsinfer.js" in text  # inlined from the install
    assert not re.search(r"""(import|from)\s*["']wsinfer-client""", text)  # no import left
    done = run(
        str(node_modules / ".bin" / "tsc"), "--noEmit", "--strict", "--module", "NodeNext",
        "--moduleResolution", "NodeNext", "--target", "ES2022", "--lib", "ES2022,DOM",
        "main.ts", cwd=app,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    probe = f"const m = await import('{bundle.as_uri()}');"
    probe += " console.log(m.state, typeof m.WsinferClient)"
    loaded = run(str(NODE), "--input-type=module", "-e", probe, cwd=app)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.split() == ["idle", "function"]
