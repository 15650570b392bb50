"""docs/serving.md's code and names against the package: every ```python block compiles, every
`jax_moe_comm...` name and every `a2a.<method>` the blocks use exists, the server loop is the
agreed-recovery loop, and docs/multinode.md lists every setting handle creation agrees on."""

import ast
import importlib
import inspect
import os
import re
import textwrap

import jax_moe_comm
from jax_moe_comm import AllToAll
from jax_moe_comm.backends import nvshmem

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
PACKAGE = "jax_moe_comm"


def read(*parts) -> str:
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
        return f.read()


def python_blocks(text: str) -> list[str]:
    return [textwrap.dedent(b) for b in re.findall(r"^```python\n(.*?)^```$", text, re.M | re.S)]


def dotted(node) -> str | None:
    """"a.b.c" of an attribute chain rooted at a plain name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id] + parts[::-1])


def package_aliases(tree) -> dict[str, str]:
    """Local name -> the jax_moe_comm path it was imported as."""
    aliases = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] == PACKAGE:
                    aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else PACKAGE
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == PACKAGE:
            for a in node.names:
                aliases[a.asname or a.name] = f"{node.module}.{a.name}"
    return aliases


def longest_chains(tree) -> set[str]:
    """Every attribute chain of the block, outermost only (a.b.c, not also a.b)."""
    chains, inner = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            name = dotted(node)
            if name:
                chains.add(name)
                if isinstance(node.value, ast.Attribute):
                    inner.add(dotted(node.value))
    return chains - inner


def resolve(path: str):
    """The object a dotted jax_moe_comm path names, importing submodules on the way; raises
    AssertionError naming the first missing part."""
    parts = path.split(".")
    assert parts[0] == PACKAGE, path
    obj = jax_moe_comm
    for i, part in enumerate(parts[1:], start=1):
        if not hasattr(obj, part) and inspect.ismodule(obj):
            try:
                importlib.import_module(".".join(parts[:i + 1]))
            except ModuleNotFoundError:
                pass
        assert hasattr(obj, part), f"serving.md uses {path}: {'.'.join(parts[:i])} has no {part}"
        obj = getattr(obj, part)
    return obj


def used_names() -> tuple[set[str], set[str]]:
    """(jax_moe_comm paths, AllToAll method names) that serving.md's python blocks use."""
    paths, methods = set(), set()
    for src in python_blocks(read("docs", "serving.md")):
        tree = ast.parse(src)
        aliases = package_aliases(tree)
        paths.update(p for p in aliases.values())
        for chain in longest_chains(tree):
            head, _, rest = chain.partition(".")
            if head == "a2a":
                methods.add(rest.split(".")[0])
            elif head in aliases:
                paths.add(aliases[head] + ("." + rest if rest else ""))
    return paths, methods


def test_every_python_block_of_the_serving_page_compiles():
    blocks = python_blocks(read("docs", "serving.md"))
    assert len(blocks) >= 2, "serving.md: the sizes example and the server loop"
    for src in blocks:
        compile(src, "serving.md", "exec")


def test_every_package_name_and_handle_method_the_page_uses_exists():
    paths, methods = used_names()
    # What the page is about must be among what it uses (so a renamed block fails here).
    assert {"poll", "recover"} <= methods, methods
    assert {"jax_moe_comm.errors.MoECommError", "jax_moe_comm.symmetric_bytes",
            "jax_moe_comm.sizes.nvshmem_symmetric_size"} <= paths, paths
    for path in sorted(paths):
        resolve(path)
    for method in sorted(methods):
        assert callable(getattr(AllToAll, method, None)), f"serving.md calls a2a.{method}()"


def test_the_names_the_page_documents_exist():
    # Named in the page's text (poll, recover, check, close; the errors; the size helpers).
    page = read("docs", "serving.md")
    for method in ("poll", "recover", "check", "close"):
        assert f"{method}()" in page, method
        assert hasattr(AllToAll, method), f"AllToAll.{method}"
    for path in ("jax_moe_comm.errors.MoECommError", "jax_moe_comm.errors.RecoveryError",
                 "jax_moe_comm.errors.PeerTimeoutError", "jax_moe_comm.errors.ProtocolError",
                 "jax_moe_comm.symmetric_bytes", "jax_moe_comm.sizes.nvshmem_symmetric_size",
                 "jax_moe_comm.finalize", "jax_moe_comm.flax.close_handles"):
        assert path.rsplit(".", 1)[1] in page, path
        resolve(path)


def test_the_server_loop_recovers_to_the_agreed_step():
    loops = [b for b in python_blocks(read("docs", "serving.md")) if ".recover()" in b]
    assert len(loops) == 1, "one server loop"
    tree = ast.parse(loops[0])
    handlers = [h for h in ast.walk(tree) if isinstance(h, ast.ExceptHandler)]
    assert any(dotted(h.type) == "MoECommError" for h in handlers), "catches MoECommError"
    handler = next(h for h in handlers if dotted(h.type) == "MoECommError")
    body = ast.unparse(ast.Module(body=handler.body, type_ignores=[]))
    assert "done = a2a.recover()" in body and "step = done // cycles_per_step" in body, body
    tries = [t for t in ast.walk(tree) if isinstance(t, ast.Try)]
    assert any("a2a.poll()" in ast.unparse(t.body[0]) for t in tries), "poll() in the try"


def creation_agreement() -> tuple[list[str], list[str]]:
    """The names NvshmemBackend.__init__ puts into the creation agreement's `shape` tuple and
    `settings` dict (read from its source, so a field added there must be documented)."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(nvshmem.NvshmemBackend.__init__)))
    shape, settings = [], []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)):
            continue
        if node.targets[0].id == "shape":
            for elt in node.value.elts:
                while isinstance(elt, (ast.BoolOp, ast.Attribute)) and not (
                        isinstance(elt, ast.Attribute) and isinstance(elt.value, ast.Name)):
                    elt = elt.values[0] if isinstance(elt, ast.BoolOp) else elt.value
                shape.append(elt.attr if isinstance(elt, ast.Attribute) else elt.id)
        elif node.targets[0].id == "settings":
            settings += [kw.arg for kw in node.value.keywords]
    return shape, settings


def test_multinode_lists_every_setting_agreed_at_creation():
    shape, settings = creation_agreement()
    assert "num_experts" in shape and "overflow" in shape and "node_size" in settings, (
        shape, settings)
    page = read("docs", "multinode.md")
    item = page[page.index("6. **The same settings on every rank.**"):
                page.index("7. **In a step, nothing waits forever.**")]
    for name in shape + settings + list(nvshmem.PROTOCOL_ENV):
        assert f"`{name}`" in item, f"multinode.md's agreed settings omit {name}"
