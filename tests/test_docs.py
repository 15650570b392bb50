"""The docs and the results they cite: the README's headline table is the docs' table, every
results link resolves, benchmarks/results holds at its top level only the runs the README and
the performance page cite (older ones in its archive/), and HISTORY.md lists every folder.
`mkdocs build --strict` itself runs in scripts/docs.sh."""

import os
import re

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
RESULTS = os.path.join(ROOT, "benchmarks", "results")


def read(*parts) -> str:
    with open(os.path.join(ROOT, *parts), encoding="utf-8") as f:
        return f.read()


def table_rows(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("|")]


def test_the_readme_headline_table_is_the_performance_page_table():
    readme = read("README.md")
    bench = readme[readme.index("\n## Performance\n"):readme.index("\n## Usage\n")]
    rows = table_rows(bench)
    assert len(rows) == 10, rows  # header, rule, 8 rows (V2-Lite and R1 at 1, 4, 16, 128 tokens)
    page = read("docs", "performance.md")
    assert "\n".join(rows) in page
    current = "benchmarks/results/2026-12-07-7db58cd-h100-packed/"
    assert f"({current}README.md)" in bench and f"({current}loop_compare.png)" in bench
    # Every figure in the table is the results folder's own (its loop_compare.md).
    figures = set(re.findall(r"\d+\.\d+", "\n".join(rows)))
    source = read(*current.split("/"), "loop_compare.md")
    assert figures <= set(re.findall(r"\d+\.\d+", source)), figures - set(
        re.findall(r"\d+\.\d+", source))


def results_folders() -> dict[str, str]:
    """Every results folder, top level and archive/, by its path under benchmarks/results."""
    folders = {}
    for parent in ("", "archive"):
        for d in os.listdir(os.path.join(RESULTS, parent)):
            if parent == "" and d == "archive":
                continue
            if os.path.isdir(os.path.join(RESULTS, parent, d)):
                folders[d] = f"{parent}/{d}" if parent else d
    return folders


def cited_results(doc: str, prefix: str) -> set[str]:
    """The results paths (relative to benchmarks/results) that doc links, each checked to exist."""
    cited = set()
    for target in re.findall(r"\]\(([^)#]+)\)", read(*doc.split("/"))):
        if not target.startswith(prefix) or "://" in target:
            continue
        rel = target[len(prefix):]
        assert os.path.exists(os.path.join(RESULTS, rel)), f"{doc} links {target}, which is missing"
        cited.add(rel)
    return cited


def test_every_results_link_resolves_and_every_results_folder_is_cited():
    folders = results_folders()
    assert folders and os.path.isfile(os.path.join(RESULTS, "HISTORY.md"))
    assert not set(folders.values()) & {"archive/archive"}, "archive/ inside archive/"
    # Every link into the results from the README and every docs page resolves.
    docs = ["README.md"] + [f"docs/{f}" for f in sorted(os.listdir(os.path.join(ROOT, "docs")))
                            if f.endswith(".md")]
    current = set()
    for doc in docs:
        for rel in cited_results(doc, "benchmarks/results/" if doc == "README.md" else "results/"):
            if doc in ("README.md", "docs/performance.md"):
                current.add(rel.split("/")[0])
    # HISTORY.md lists every folder, top level and archived, by its path.
    history = {rel.rsplit("/", 1)[0] if rel.endswith(".md") else rel.rstrip("/")
               for rel in cited_results("benchmarks/results/HISTORY.md", "")}
    missing = set(folders.values()) - history
    assert not missing, f"results folders HISTORY.md does not list: {sorted(missing)}"
    # The top level holds exactly the runs the README and the performance page cite: what is no
    # longer cited there belongs in archive/.
    top = {d for d, path in folders.items() if path == d}
    assert top <= current, f"top level, not cited by README or performance.md: {top - current}"


def test_every_nav_page_exists_and_every_page_is_in_the_nav():
    nav = re.findall(r"^  - [^:]+: (\S+\.md)$", read("mkdocs.yml"), re.M)
    assert "index.md" in nav and "api.md" in nav and "notes.md" in nav
    pages = {f for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md")}
    assert set(nav) == pages, (set(nav) ^ pages)


def test_the_api_reference_lists_the_public_surface():
    import jax_moe_comm

    api = read("docs", "api.md")
    listed = set(re.findall(r"^        - (\w+)$", api, re.M))
    modules = set(re.findall(r"^::: jax_moe_comm\.(\w+)$", api, re.M))
    missing = set(jax_moe_comm.__all__) - listed - modules
    assert not missing, f"in __all__ but not in docs/api.md: {missing}"
    assert not (listed - set(jax_moe_comm.__all__)), listed - set(jax_moe_comm.__all__)
    assert "testing" not in modules and "DispatchSum" not in api.split("\n\n", 2)[-1]
