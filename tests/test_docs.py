"""The docs and the results they cite: the README's headline table is the docs' table, every
results link resolves, and benchmarks/results holds only the runs something cites (older ones
are in its HISTORY.md). `mkdocs build --strict` itself runs in scripts/docs.sh."""

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


def test_every_results_link_resolves_and_every_results_folder_is_cited():
    cited = set()
    for doc, prefix in (("README.md", "benchmarks/results/"), ("docs/performance.md", "results/"),
                        ("benchmarks/results/HISTORY.md", "")):
        text = read(*doc.split("/"))
        for target in re.findall(r"\]\(([^)#]+)\)", text):
            if not target.startswith(prefix) or "://" in target:
                continue
            rel = target[len(prefix):]
            path = os.path.join(RESULTS, rel)
            assert os.path.exists(path), f"{doc} links {target}, which is missing"
            cited.add(rel.split("/")[0])
    folders = {d for d in os.listdir(RESULTS) if os.path.isdir(os.path.join(RESULTS, d))}
    assert folders and folders <= cited, f"results folders nothing cites: {folders - cited}"
    assert os.path.isfile(os.path.join(RESULTS, "HISTORY.md"))


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
