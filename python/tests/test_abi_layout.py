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
        if isinstance(cls, type) and issubclass(cls, ctypes.Structure) and cls not in (ctypes.Structure, _lib._Struct)
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
        ("wm_group_config_init", "GroupConfig"),
        ("wm_net_config_init", "NetConfig"),
        ("wm_fanout_config_init", "FanoutConfig"),
        ("wm_memory_config_init", "MemoryConfig"),
        ("wm_tensor_desc_init", "TensorDesc"),
        ("wm_shard_placement_init", "ShardPlacement"),
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


# -- functions and enums ----------------------------------------------------
# The same check for what the binding declares beside its structs: every
# function prototype in `_lib.PROTOTYPES` (restype and argtypes) against the
# header's declaration, and every enum value the Python side copies against
# the header's enums and macros.

DECL_RE = re.compile(r"^(?P<ret>[\w ]+?\**)\s*\b(?P<name>wm_\w+)\((?P<params>[^)]*)\);", re.M | re.S)
HANDLES = {"wm_manager", "wm_publisher", "wm_controller"}
SCALARS = {
    "uint32_t": ctypes.c_uint32, "int32_t": ctypes.c_int32, "uint64_t": ctypes.c_uint64,
    "size_t": ctypes.c_size_t, "wm_result": ctypes.c_uint32,
}


def header_text_without_comments():
    text = HEADER.read_text()
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def header_functions():
    """`{name: (return type, [parameter types])}`, types as written in C
    (`const` dropped, pointers as trailing `*`)."""
    out = {}
    for m in DECL_RE.finditer(header_text_without_comments()):
        params = [" ".join(p.split()) for p in m.group("params").split(",")]
        types = []
        for p in params:
            if p in ("void", ""):
                continue
            p = p.replace("const ", "")
            stars = p.count("*")
            base = p.replace("*", " ").split()[0]  # the type; the last word is the name
            types.append(base + "*" * stars)
        ret = " ".join(m.group("ret").replace("const ", "").split()).replace(" *", "*")
        out[m.group("name")] = (ret, types)
    return out


def ctype_of(c_type):
    """The ctypes type the binding must use for a C type of the header."""
    stars = len(c_type) - len(c_type.rstrip("*"))
    base = c_type.rstrip("*")
    if base == "void":
        return {0: None, 1: ctypes.c_void_p, 2: ctypes.POINTER(ctypes.c_void_p)}[stars]
    if base == "char" and stars == 1:
        return ctypes.c_char_p
    if base in HANDLES:  # opaque: a pointer-sized value, its address for out-params
        return {1: ctypes.c_void_p, 2: ctypes.POINTER(ctypes.c_void_p)}[stars]
    t = SCALARS.get(base) or getattr(_lib, python_name(base))
    for _ in range(stars):
        t = ctypes.POINTER(t)
    return t


def test_header_functions_parse():
    fns = header_functions()
    assert fns["wm_init"] == ("wm_result", ["wm_config*", "wm_manager**"])
    assert fns["wm_version"] == ("char*", [])
    assert fns["wm_destroy"] == ("void", ["wm_manager*"])
    assert len(fns) >= 40


def test_every_prototype_matches_the_header():
    fns = header_functions()
    problems = []
    for name, (restype, argtypes) in _lib.PROTOTYPES.items():
        if name not in fns:
            problems.append(f"{name}: declared in _lib.py, not in the header")
            continue
        c_ret, c_args = fns[name]
        if ctype_of(c_ret) is not restype:
            problems.append(f"{name}: restype {restype} in Python, {c_ret} ({ctype_of(c_ret)}) in C")
        want = [ctype_of(a) for a in c_args]
        if len(want) != len(argtypes) or any(w is not a for w, a in zip(want, argtypes)):
            problems.append(f"{name}: argtypes {argtypes} in Python, {c_args} in C")
        fn = getattr(_lib.LIB, name)  # and the library got them
        if fn.restype is not restype or list(fn.argtypes) != list(argtypes):
            problems.append(f"{name}: the loaded function's prototype is not PROTOTYPES'")
    assert problems == []


def test_the_binding_uses_every_current_function():
    """Every function of the header is declared, but the deprecated ones."""
    deprecated = {"wm_publisher_add_tensor", "wm_publisher_add_device_tensor", "wm_publisher_add_shard",
                  "wm_publisher_add_device_shard", "wm_shard_placement_init"}
    missing = set(header_functions()) - set(_lib.PROTOTYPES) - deprecated
    assert missing == set()


def header_enums():
    """`{enum name: {constant: value}}` from the header's `enum wm_x ... { ... };`."""
    text = header_text_without_comments()
    text = re.sub(r"^#.*$", "", text, flags=re.M)  # the C23 / C++ underlying-type lines
    enums = {}
    for m in re.finditer(r"enum (?P<name>wm_\w+)\s*(:\s*\w+\s*)?\{(?P<body>[^}]*)\}", text):
        values = {}
        for item in m.group("body").split(","):
            item = item.strip()
            if item:
                k, v = (x.strip() for x in item.split("="))
                values[k] = int(v)
        enums[m.group("name")] = values
    return enums


def header_macros():
    return {m.group(1): int(m.group(2)) for m in re.finditer(r"^#define (WM_\w+) (\d+)$", HEADER.read_text(), re.M)}


def test_enum_values_match_header():
    from weight_manager import manager, types

    enums = header_enums()
    assert len(enums) == 9, sorted(enums)

    def same(c_enum, prefix, py):
        want = {k[len(prefix):]: v for k, v in enums[c_enum].items()}
        assert py == want, c_enum

    same("wm_result", "WM_", {m.name: m.value for m in types.Result})
    same("wm_state", "WM_STATE_", {m.name: m.value for m in types.State})
    same("wm_source", "WM_SOURCE_", {m.name: m.value for m in types.Source})
    # Python spells F8_E4M3 where C has F8E4M3.
    same("wm_dtype", "WM_DTYPE_", {m.name.replace("_", ""): m.value for m in types.DType})
    same("wm_log_level", "WM_LOG_LEVEL_", {k.upper(): v for k, v in manager._LOG_LEVELS.items()})
    same("wm_request_outcome", "WM_REQUEST_OUTCOME_",
         {name.upper(): i for i, name in enumerate(manager.Controller.OUTCOMES)})
    same("wm_delta_fallback", "WM_DELTA_FALLBACK_", {m.name: m.value for m in types.DeltaFallback})
    same("wm_quant_scheme", "WM_QUANT_SCHEME_", {m.name: m.value for m in types.QuantScheme})
    assert enums["wm_memory"]["WM_MEMORY_DEVICE"] == manager.MEMORY_DEVICE
    macros = header_macros()
    flags = ("VERIFY_CHECKSUMS", "IN_PLACE", "SKIP_UNKNOWN", "SKIP_NETWORK_CHECKSUMS", "WHOLE", "DELTAS")
    for py in flags:
        assert macros["WM_UPDATE_" + py] == getattr(types, py), py
    assert {k for k in macros if k.startswith("WM_UPDATE_")} == {"WM_UPDATE_" + p for p in flags}
