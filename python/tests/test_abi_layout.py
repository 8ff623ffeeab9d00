"""The ctypes structs in `weight_manager._lib` match `include/weight_manager.h`.

The header is the source of truth (cbindgen writes it from the Rust
structs). This test parses every `typedef struct { ... } wm_x;` block in it,
compiles a C program printing the size of each struct and the offset and
size of each of its fields, and compares that with the ctypes `Structure` of
the same name (`wm_update_stats` -> `UpdateStats`): same struct size, same
fields in the same order, each at the same offset with the same size. A field
added in Rust (and so in the header) but not in Python fails here, which
matters because `wm_config_init` and its siblings write `sizeof(wm_x)` bytes
into the Python buffer.
"""

import ctypes
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from weight_manager import _lib

ROOT = Path(__file__).resolve().parents[2]
HEADER = ROOT / "include" / "weight_manager.h"

STRUCT_RE = re.compile(r"typedef struct \{(?P<body>[^}]*)\}\s*(?P<name>wm_\w+)\s*;")
# `type name;` or `type name[N];`, the name being the last identifier.
FIELD_RE = re.compile(r"(?P<name>\w+)\s*(\[[^\]]*\])?\s*;$")


def header_structs():
    """`{struct name: [field names in order]}` from the header's text."""
    text = HEADER.read_text()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    structs = {}
    for m in STRUCT_RE.finditer(text):
        fields = []
        for decl in m.group("body").split(";"):
            decl = " ".join(decl.split())
            if not decl:
                continue
            field = FIELD_RE.search(decl + ";")
            assert field, f"cannot parse field {decl!r} of {m.group('name')}"
            fields.append(field.group("name"))
        structs[m.group("name")] = fields
    return structs


def python_name(c_name):
    """`wm_update_stats` -> `UpdateStats`."""
    return "".join(part.capitalize() for part in c_name[len("wm_"):].split("_"))


def c_layout(structs, tmp_path):
    """`{struct: (size, {field: (offset, size)})}` as the C compiler lays them out."""
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler to check the ctypes layout against")
    lines = ["#include <stdio.h>", "#include <stddef.h>", '#include "weight_manager.h"', "int main(void) {"]
    for struct, fields in structs.items():
        lines.append(f'  printf("S {struct} %zu\\n", sizeof({struct}));')
        for f in fields:
            lines.append(
                f'  printf("F {struct} {f} %zu %zu\\n", offsetof({struct}, {f}), sizeof((({struct} *)0)->{f}));'
            )
    lines += ["  return 0;", "}"]
    src = tmp_path / "layout.c"
    src.write_text("\n".join(lines) + "\n")
    exe = tmp_path / "layout"
    subprocess.run([cc, "-std=c11", "-I", str(HEADER.parent), str(src), "-o", str(exe)], check=True)
    out = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout
    layout = {}
    for line in out.splitlines():
        kind, struct, *rest = line.split()
        if kind == "S":
            layout[struct] = (int(rest[0]), {})
        else:
            layout[struct][1][rest[0]] = (int(rest[1]), int(rest[2]))
    return layout


def python_structs():
    return {
        name: cls
        for name, cls in vars(_lib).items()
        if isinstance(cls, type) and issubclass(cls, ctypes.Structure) and cls is not ctypes.Structure
    }


def test_header_has_structs():
    structs = header_structs()
    assert "wm_config" in structs and "struct_size" in structs["wm_config"]
    assert len(structs) >= 9


def test_every_struct_has_a_ctypes_twin_and_back():
    c_names = {python_name(s) for s in header_structs()}
    py_names = set(python_structs())
    assert c_names - py_names == set(), "structs in the header missing from _lib.py"
    assert py_names - c_names == set(), "structs in _lib.py missing from the header"


def test_ctypes_layout_matches_header(tmp_path):
    structs = header_structs()
    layout = c_layout(structs, tmp_path)
    py = python_structs()
    problems = []
    for struct, fields in structs.items():
        cls = py[python_name(struct)]
        py_fields = [f[0] for f in cls._fields_]
        if py_fields != fields:
            problems.append(f"{struct}: fields {py_fields} in Python, {fields} in C")
            continue
        size, offsets = layout[struct]
        if ctypes.sizeof(cls) != size:
            problems.append(f"{struct}: sizeof {ctypes.sizeof(cls)} in Python, {size} in C")
        for name, ctype in cls._fields_:
            c_off, c_size = offsets[name]
            py_off, py_size = getattr(cls, name).offset, ctypes.sizeof(ctype)
            if (py_off, py_size) != (c_off, c_size):
                problems.append(f"{struct}.{name}: offset/size {py_off}/{py_size} in Python, {c_off}/{c_size} in C")
    assert problems == []


def test_constants_match_header():
    text = HEADER.read_text()
    for py, c in (("VERSION_BUF", "WM_VERSION_BUF"), ("MAX_NDIM", "WM_MAX_NDIM")):
        m = re.search(rf"#define {c} (\d+)", text)
        assert m and int(m.group(1)) == getattr(_lib, py), c
    m = re.search(r"#define WM_MAX_PIECES \(1 << (\d+)\)", text)
    assert m and 1 << int(m.group(1)) == _lib.MAX_PIECES, "WM_MAX_PIECES"


@pytest.mark.parametrize(
    "init, cls",
    [
        ("wm_config_init", "Config"),
        ("wm_param_desc_init", "ParamDesc"),
        ("wm_update_request_init", "UpdateRequest"),
        ("wm_publisher_config_init", "PublisherConfig"),
    ],
)
def test_init_writes_the_python_size(init, cls):
    """The library itself (not only the header) agrees: each init function
    writes `struct_size`; run it on a buffer with room to spare so a Python
    struct that is too small shows as a mismatch, not a corrupted heap."""
    struct = getattr(_lib, cls)
    buf = ctypes.create_string_buffer(ctypes.sizeof(struct) + 4096)
    assert getattr(_lib.LIB, init)(ctypes.cast(buf, ctypes.POINTER(struct))) == 0
    assert ctypes.c_uint32.from_buffer(buf).value == ctypes.sizeof(struct)
