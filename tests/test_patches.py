"""patches/apply.py on a tiny fake upstream tree, and the shape of the real patch series."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PATCHES = ROOT / "patches"
APPLY_PY = PATCHES / "apply.py"

UPSTREAM = {
    "a.txt": "line1\nline2\nline3\n",
    "src/b.c": "int b(void) { return 1; }\n",
    "ggml/src/c.cpp": "// c\n",
}

HEADER = """From 0000000000000000000000000000000000000000 Mon Sep 17 00:00:00 2001
From: test <test@example.invalid>
Subject: [PATCH] {subject}

What: {subject}.
Switch off: nothing (a test patch).
---
"""

GOOD = HEADER.format(subject="fake: change line2 and add a file") + """diff --git a/a.txt b/a.txt
--- a/a.txt
+++ b/a.txt
@@ -1,3 +1,3 @@
 line1
-line2
+line2 patched
 line3
diff --git a/src/new.h b/src/new.h
new file mode 100644
--- /dev/null
+++ b/src/new.h
@@ -0,0 +1 @@
+#define NEW 1
"""

GOOD_V2 = GOOD.replace("+line2 patched", "+line2 patched again")

BAD = HEADER.format(subject="fake: a patch against another tree") + """diff --git a/src/b.c b/src/b.c
--- a/src/b.c
+++ b/src/b.c
@@ -1 +1 @@
-int b(void) { return 7; }
+int b(void) { return 8; }
"""


def _write_tree(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        p = root / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def _read_tree(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): p.read_text() for p in root.rglob("*") if p.is_file()}


@pytest.fixture
def layout(tmp_path):
    up = tmp_path / "upstream"
    _write_tree(up, UPSTREAM)
    pdir = tmp_path / "patches"
    pdir.mkdir()
    return up, tmp_path / "work", pdir


def _series(pdir: Path, patches: dict[str, str], extra_lines: tuple[str, ...] = ()) -> Path:
    for name, text in patches.items():
        (pdir / name).write_text(text)
    s = pdir / "series"
    s.write_text("# a comment line\n" + "".join(f"{n}  # trailing comment\n" for n in patches)
                 + "".join(line + "\n" for line in extra_lines))
    return s


def _apply(up: Path, work: Path, series: Path, sources: Path | None = None) -> subprocess.CompletedProcess:
    extra = ["--sources", str(sources)] if sources else []
    return subprocess.run([sys.executable, str(APPLY_PY), "--upstream", str(up), "--work", str(work),
                           "--series", str(series), *extra], capture_output=True, text=True, timeout=60)


def _sources(pdir: Path, dest: str) -> tuple[Path, Path]:
    """Our file sched/ours.cpp (named from the folder above patches/) and a patches/sources that puts it at dest."""
    src = pdir.parent / "sched" / "ours.cpp"
    src.parent.mkdir(exist_ok=True)
    src.write_text("// ours v1\n")
    manifest = pdir / "sources"
    manifest.write_text(f"# our files\nsched/ours.cpp   {dest}   0001\n")
    return src, manifest


def test_good_patch_applies_and_baseline_stays_pristine(layout):
    up, work, pdir = layout
    res = _apply(up, work, _series(pdir, {"0001-good.patch": GOOD}))
    assert res.returncode == 0, res.stderr
    baseline = _read_tree(work / "baseline" / "src")
    patched = _read_tree(work / "patched" / "src")
    assert baseline == UPSTREAM, "the baseline tree must be the pristine upstream tree"
    assert _read_tree(up) == UPSTREAM, "the upstream tree itself must not be modified"
    assert patched["a.txt"] == "line1\nline2 patched\nline3\n"
    assert patched["src/new.h"] == "#define NEW 1\n"
    assert {k: v for k, v in patched.items() if k not in ("a.txt", "src/new.h")} == \
        {k: v for k, v in UPSTREAM.items() if k != "a.txt"}


def test_rebuild_touches_only_changed_files(layout):
    up, work, pdir = layout
    series = _series(pdir, {"0001-good.patch": GOOD})
    assert _apply(up, work, series).returncode == 0
    b_c = work / "patched" / "src" / "src" / "b.c"
    a_txt = work / "patched" / "src" / "a.txt"
    old = 1_000_000_000
    os.utime(b_c, (old, old))
    os.utime(a_txt, (old, old))
    # unchanged series: nothing to do
    assert _apply(up, work, series).returncode == 0
    assert a_txt.stat().st_mtime == old and b_c.stat().st_mtime == old
    # an edited patch: only the file it changes is rewritten
    (pdir / "0001-good.patch").write_text(GOOD_V2)
    res = _apply(up, work, series)
    assert res.returncode == 0, res.stderr
    assert a_txt.read_text() == "line1\nline2 patched again\nline3\n"
    assert a_txt.stat().st_mtime != old
    assert b_c.stat().st_mtime == old, "an unchanged file was rewritten (forces needless recompiles)"
    assert _read_tree(work / "baseline" / "src") == UPSTREAM


def test_our_files_go_in_before_the_patches_and_a_rebuild_rewrites_only_what_changed(layout):
    up, work, pdir = layout
    src, manifest = _sources(pdir, "ggml/src/ours.cpp")
    series = _series(pdir, {"0001-good.patch": GOOD})
    res = _apply(up, work, series, manifest)
    assert res.returncode == 0, res.stderr
    patched = _read_tree(work / "patched" / "src")
    assert patched["ggml/src/ours.cpp"] == "// ours v1\n" and patched["a.txt"] == "line1\nline2 patched\nline3\n"
    assert _read_tree(work / "baseline" / "src") == UPSTREAM
    ours, a_txt = work / "patched" / "src" / "ggml" / "src" / "ours.cpp", work / "patched" / "src" / "a.txt"
    old = 1_000_000_000
    os.utime(ours, (old, old))
    os.utime(a_txt, (old, old))
    src.write_text("// ours v2\n")   # an edit of our file re-runs apply.py (its stamp) and rewrites that file alone
    res = _apply(up, work, series, manifest)
    assert res.returncode == 0, res.stderr
    assert ours.read_text() == "// ours v2\n" and ours.stat().st_mtime > old
    assert a_txt.stat().st_mtime == old, "an unchanged file was rewritten (forces needless recompiles)"


def test_our_file_may_not_replace_an_upstream_file(layout):
    up, work, pdir = layout
    _, manifest = _sources(pdir, "src/b.c")
    res = _apply(up, work, _series(pdir, {"0001-good.patch": GOOD}), manifest)
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "ours.cpp would replace src/b.c" in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert not (work / "trees.stamp").exists()


def test_unappliable_patch_exits_2_and_names_it(layout):
    up, work, pdir = layout
    res = _apply(up, work, _series(pdir, {"0001-good.patch": GOOD, "0002-other-tree.patch": BAD}))
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "0002-other-tree.patch" in res.stderr, res.stderr
    assert "does not apply" in res.stderr and "Fix" in res.stderr, res.stderr
    assert "0001-good.patch" not in res.stderr.split("\n")[0], "the error must name the failing patch"
    assert "Traceback" not in res.stderr
    assert not (work / "trees.stamp").exists(), "a failed run must not mark the trees as up to date"
    assert not (work / "patched" / "src" / "a.txt").exists(), "no half-patched tree"


def test_series_naming_a_missing_patch_fails_clearly(layout):
    up, work, pdir = layout
    res = _apply(up, work, _series(pdir, {"0001-good.patch": GOOD}, extra_lines=("0002-missing.patch",)))
    assert res.returncode == 2, (res.returncode, res.stderr)
    assert "0002-missing.patch" in res.stderr and "do not exist" in res.stderr, res.stderr
    assert "Traceback" not in res.stderr
    assert not (work / "patched").exists()


# --- the real series -------------------------------------------------------------------------------------

def _real_series() -> list[str]:
    names = []
    for line in (PATCHES / "series").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            names.append(line)
    return names


def test_real_series_lists_existing_patches_in_order():
    names = _real_series()
    assert names, "patches/series is empty"
    for n in names:
        assert (PATCHES / n).is_file(), f"patches/series names {n}, which does not exist"
        assert re.fullmatch(r"\d{4}-[A-Za-z0-9][A-Za-z0-9._-]*\.patch", n), f"{n} does not follow NNNN-area-what.patch"
    assert names == sorted(names), "series is not in numeric order"
    assert len(set(names)) == len(names), "a patch is listed twice"
    on_disk = sorted(p.name for p in PATCHES.glob("*.patch"))
    assert on_disk == sorted(names), f"patches not in series: {sorted(set(on_disk) - set(names))}"


def _header(text: str) -> str:
    """The commit message: from the Subject line to the '---' line before the diffstat."""
    m = re.search(r"^Subject: .*?(?=^---$)", text, re.S | re.M)
    return m.group(0) if m else ""


@pytest.mark.parametrize("name", _real_series())
def test_real_patch_has_a_header(name):
    text = (PATCHES / name).read_text()
    header = _header(text)
    assert header, f"{name}: no 'Subject:' line followed by a '---' separator"
    assert header.startswith("Subject: [PATCH] "), f"{name}: {header.splitlines()[0]!r}"
    body = header.split("\n\n", 1)[1] if "\n\n" in header else ""
    assert len(body.strip()) > 100, f"{name}: the header has no body (what / why / switch)"
    assert re.search(r"switch", body, re.I), f"{name}: the header does not say how to switch it off"
    assert "diff --git" in text.split(header, 1)[1], f"{name}: no diff after the header"


def test_every_runtime_switch_is_documented_in_a_patch_header():
    headers = "\n".join(_header((PATCHES / n).read_text()) for n in _real_series())
    # every switch of the extension's table (ggml_sched_pp_params in our ggml-backend-pp-base.cpp)
    table = (ROOT / "pyllama_pp" / "native" / "sched" / "ggml-backend-pp-base.cpp").read_text()
    names = set(re.findall(r'^\s*GGML_SCHED_PP_ROW\("([A-Z_0-9]+)",', table, re.M))
    assert {"GATE", "UPLOAD_ALL", "OVERLAP", "STABLE_RESERVE", "PREFETCH"} <= names, names
    assert len(names) <= 20, names   # (one off-switch per mechanism, and the tuning knobs)
    for name in sorted(names):
        assert re.search(rf"GGML_SCHED_PP_{name}\b", headers), f"GGML_SCHED_PP_{name} is not in any patch header"
