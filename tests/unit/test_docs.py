"""The README and docs/: every bash and python block is run by a test or says why it cannot be,
every test file the pages name exists, the pages agree with the code they describe, and the
planner's commands run as written."""

import collections
import re
import tomllib

import pytest
from support.docs import ROOT, all_blocks, blocks, pages

CODE = {"bash", "sh", "shell", "console", "python", "py", "pycon"}


def test_every_code_block_is_marked_runnable_or_says_why_not():
    blocks_ = all_blocks()
    unnamed = [str(b) for b in blocks_ if not b.language]
    assert not unnamed, f"fences without a language (use ```text for output): {unnamed}"
    unmarked = [str(b) for b in blocks_ if b.language in CODE and b.kind is None]
    assert not unmarked, (
        "code blocks without a marker on the line before the fence: <!-- runnable: NAME --> (and a test that "
        f"runs it through support.docs.runnable_block) or <!-- not-run: REASON -->: {unmarked}"
    )
    blank = [str(b) for b in blocks_ if b.kind in ("runnable", "not-run") and not b.label]
    assert not blank, f"a runnable block needs a name, a not-run block a reason: {blank}"
    commands = [b for b in blocks_ if b.kind == "test-command"]
    assert [b.page for b in commands] == ["README.md"], "one test command, in the README (.ci/run reads it)"
    assert "<!-- test-command -->" in (ROOT / ".ci" / "run").read_text()


def test_every_marker_is_right_before_a_fence():
    for page in pages():
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines):
            if re.match(r"^<!-- (runnable|not-run|test-command)\b", line):
                following = lines[i + 1] if i + 1 < len(lines) else ""
                assert following.startswith("```"), f"{page.relative_to(ROOT)}:{i + 1}: a marker not before a fence"


def test_every_runnable_block_is_run_by_a_test():
    """Read statically: some test under tests/ passes the block's page and name to runnable_block."""
    runnable = [b for b in all_blocks() if b.kind == "runnable"]
    names = collections.Counter(b.label for b in runnable)
    assert not [n for n, k in names.items() if k > 1], f"runnable names must be unique across pages: {names}"
    sources = "\n".join(p.read_text() for p in (ROOT / "tests").rglob("*.py"))
    calls = set(re.findall(r"runnable_block\(\s*[\"']([^\"']+)[\"'],\s*[\"']([^\"']+)[\"']\s*\)", sources))
    missing = [str(b) + f" {b.label!r}" for b in runnable if (b.page, b.label) not in calls]
    assert not missing, f"runnable blocks no test runs (call support.docs.runnable_block(PAGE, NAME)): {missing}"
    unknown = sorted(calls - {(b.page, b.label) for b in runnable})
    assert not unknown, f"tests ask for blocks no page marks runnable: {unknown}"


def test_the_test_files_the_pages_name_exist():
    named = {m for page in pages() for m in re.findall(r"\btests/[\w/]+\.py\b", page.read_text())}
    missing = [n for n in sorted(named) if not (ROOT / n).exists()]
    assert named and not missing, f"the pages name test files that do not exist: {missing}"


def test_the_readme_and_the_site_list_every_page():
    docs = {p.name for p in (ROOT / "docs").glob("*.md")}
    readme = {"index.md"}  # the site's home: the README's counterpart
    readme |= set(re.findall(r"\(docs/([\w-]+\.md)\)", (ROOT / "README.md").read_text()))
    assert readme == docs, f"the README's map of the docs: missing {docs - readme}, unknown {readme - docs}"
    nav = set(re.findall(r":\s*([\w-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), re.M))
    assert nav == docs, f"mkdocs.yml's nav: missing {docs - nav}, unknown {nav - docs}"


def test_the_home_page_is_the_readme_with_an_install_and_goals():
    """The site's home page says what the README says (its opening paragraph, its feature list with
    the links the site needs, its Quickstart's two commands as they are), and adds how to install
    and where to go next."""
    readme, home = (ROOT / "README.md").read_text(), (ROOT / "docs" / "index.md").read_text()

    def features(text: str) -> str:
        return text[text.index("- **Model**") : text.index("\n## ", text.index("- **Model**"))]

    assert readme.split("\n\n")[1] == home.split("\n\n")[1], "the opening paragraphs differ"
    assert features(readme).replace("(docs/", "(") == features(home), "the feature lists differ"
    quickstart = {b.code for b in blocks(ROOT / "README.md") if b.language == "bash"}
    assert len(quickstart) == 2 and quickstart <= {b.code for b in blocks(ROOT / "docs" / "index.md")}
    for heading in ("## Install", "## Quickstart", "## Pick your goal"):
        assert heading in home
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert f"Python {project['requires-python'].removeprefix('>=')} or later" in home and "python3 -m venv" in home
    assert "cuda12" in project["optional-dependencies"] and "pip install -e '.[cuda12]'" in home
    goals = home[home.index("## Pick your goal") : home.index("## What is in it")]
    linked = set(re.findall(r"\(([\w-]+\.md)", goals))
    assert {"data.md", "planner.md", "cluster.md", "fine-tuning.md", "serving.md"} <= linked


def test_the_troubleshooting_page_quotes_jaxllms_messages_as_they_print(tmp_path):
    """Each of jaxllm's errors on the page, produced here by the code that raises it, as a command
    prints it (`error: ` and the message; the missing run's path as the page writes it)."""
    from jaxllm import cli
    from jaxllm.checkpoint.params import stored_config
    from jaxllm.config import ParallelConfig, load_config, validate
    from jaxllm.errors import JaxllmError
    from jaxllm.train.dry_run import ensure_fake_devices

    tiny = load_config(str(ROOT / "configs" / "tiny.py"))

    def printed(call) -> str:
        with pytest.raises(JaxllmError) as raised:
            call()
        return f"error: {raised.value}"

    quoted = [
        printed(lambda: validate(tiny.updated(parallel=dict(tensor=8, data=1)), 8)),
        printed(lambda: ParallelConfig(tensor=2).mesh_shape(1)),
        printed(lambda: ensure_fake_devices(tiny.updated(parallel=dict(tensor=8)))),
        printed(lambda: cli.typed_overrides({"train.stpes": "5"})),
        printed(lambda: stored_config(tmp_path / "runs" / "tiyn")).replace(str(tmp_path), "/home/me"),
    ]
    page = (ROOT / "docs" / "troubleshooting.md").read_text()
    assert not [q for q in quoted if f"```text\n{q}\n```" not in page]


def test_the_glossary_defines_each_term_once_and_only_terms_the_pages_use():
    """Each bold term of the glossary (an entry may define several: "FSDP / ZeRO", "TTFT, TPOT")
    once; the terms newcomers asked about among them; and each one used on some other page."""
    glossary = ROOT / "docs" / "glossary.md"
    terms = [t.strip("`") for bold in re.findall(r"\*\*([^*]+)\*\*", glossary.read_text())
             for t in re.split(r",\s*|\s*/\s*", bold)]  # fmt: skip
    lowered = [t.lower() for t in terms]
    assert len(set(lowered)) == len(lowered), f"defined twice: {[t for t in terms if lowered.count(t.lower()) > 1]}"
    assert {"mfu", "fsdp", "zero", "remat", "gqa", "ttft", "e4m3", "e5m2", "bubble", "goodput"} <= set(lowered)
    others = " ".join(re.sub(r"\s+", " ", p.read_text().lower()) for p in pages() if p != glossary)
    assert not [t for t in terms if t.lower() not in others], "terms no other page uses"


# Pictures of measurements, not of the code: `python scripts/bench_bubble.py --plot docs/img`.
MEASURED = tuple(
    f"pipeline-measured-{kind}.svg" for kind in ("1f1b", "interleaved_1f1b", "zero_bubble", "interleaved_zero_bubble")
)


def test_every_picture_is_drawn_from_the_code_as_it_is_and_shown():
    """Each picture's SVG carries the digest of what it drew; the code's data today must have the
    same one (else: python -m jaxllm.pictures), and some page must show it."""
    from jaxllm.pictures import PICTURES, digest, drawn_digest

    shown = " ".join(page.read_text() for page in pages())
    for name, picture in PICTURES.items():
        svg = ROOT / "docs" / "img" / name
        stale = f"{name} is stale: python -m jaxllm.pictures"
        assert svg.exists() and drawn_digest(svg) == digest(picture.what()), stale
        assert f"(img/{name})" in shown, f"no page shows {name}"
    for name in MEASURED:
        assert (ROOT / "docs" / "img" / name).exists() and f"(img/{name})" in shown, f"{name}: not drawn or not shown"
    drawn = sorted([*PICTURES, *MEASURED])
    assert sorted(p.name for p in (ROOT / "docs" / "img").iterdir()) == drawn, "pictures nothing draws"


def test_the_changelogs_newest_release_is_the_packages_version():
    import datetime

    import jaxllm

    changelog = (ROOT / "docs" / "changelog.md").read_text()
    releases = re.findall(r"^## (\d+\.\d+\.\d+) — (\d{4}-\d\d-\d\d)$", changelog, re.M)
    assert releases and releases[0][0] == jaxllm.__version__, f"the newest entry {releases[:1]}, not the version"
    versions = [tuple(map(int, v.split("."))) for v, _ in releases]
    dates = [datetime.date.fromisoformat(d) for _, d in releases]
    assert versions == sorted(versions, reverse=True) and dates == sorted(dates, reverse=True), "newest first"


def test_each_glossary_term_links_to_its_one_definition_from_the_pages_that_use_it():
    """The site's hook (docs_hooks/glossary_links.py) links each term's first use on a page, outside
    code, to the anchor it puts before the term's definition."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("glossary_links", ROOT / "docs_hooks" / "glossary_links.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    glossary = ROOT / "docs" / "glossary.md"
    defined = re.findall(r'<a id="(term-[\w-]+)"></a>', hook.anchor_terms(glossary.read_text()))
    assert len(defined) == len(set(defined)) == len(hook.terms())
    linked = collections.Counter()
    for page in pages()[1:]:
        if page != glossary:
            linked.update(set(re.findall(r"\]\(glossary\.md#(term-[\w-]+)\)", hook.link_terms(page.read_text()))))
    assert set(linked) == set(defined), f"terms no page links: {set(defined) - set(linked)}"
    training = hook.link_terms((ROOT / "docs" / "training.md").read_text())
    assert "[MFU](glossary.md#term-mfu)" in training


def test_every_benchmark_block_names_its_command_machine_date_and_versions():
    paragraphs = (ROOT / "docs" / "benchmarks.md").read_text().split("\n\n")
    measured = [p for p in paragraphs if "Command:" in p]
    assert len(measured) >= 10
    for p in measured:
        assert "Machine:" in p and re.search(r"Date: \d{4}-\d\d-\d\d", p) and "Versions: jax" in p, p


def test_the_profiling_page_gives_the_bands_the_warnings_use():
    from jaxllm.profile.health import BANDS

    page = re.sub(r"\s+", " ", (ROOT / "docs" / "profiling.md").read_text())
    low, high = (round(x * 100) for x in BANDS["memory_peak_fraction"])
    assert f"warned outside {low}–{high} %" in page and f"| peak {low}–{high} %" in page
    assert f"communication (under {round(BANDS['comm_share'][1] * 100)} % of the step)" in page
    assert f"the pipeline bubble (under {round(BANDS['bubble_measured'][1] * 100)} %)" in page


def test_the_planners_mfu_carries_what_a_gpu_measured_beside_it():
    """The planner page's caveat and the benchmarks page quote the same H200 figures: the planner's
    estimates for that step, as it computes them today, against the measured MFU."""
    from jaxllm.config import load_config
    from jaxllm.plan.estimate import estimate
    from jaxllm.plan.hardware import ACCELERATORS

    overrides = {"parallel.fsdp": 1, "train.batch_size": 8, "train.grad_accum_steps": 1}
    remats = ("full", "selective")
    planned = [estimate(load_config(str(ROOT / "configs" / "1b.py"), overrides | {"model.remat": remat}),
                        ACCELERATORS["h200"]).mfu * 100 for remat in remats]  # fmt: skip
    table = (ROOT / "docs" / "benchmarks.md").read_text()
    measured = [float(re.search(rf"^\| {remat} \| [\d.]+ \| [\d,]+ \| ([\d.]+) %", table, re.M).group(1))
                for remat in remats]  # fmt: skip
    (p_full, p_sel), (m_full, m_sel) = planned, measured
    caveat = (f"it estimated {p_full:.0f} % and {p_sel:.0f} % MFU against {m_full:.1f} % and {m_sel:.1f} % measured, "
              f"{p_full / m_full:.1f}–{p_sel / m_sel:.1f}× too high")
    assert caveat in _page("planner.md")
    assert f"estimates {p_full:.0f} % MFU (`full`) and {p_sel:.0f} % (`selective`)" in _page("benchmarks.md")


def _page(name: str) -> str:
    return re.sub(r"\s+", " ", (ROOT / "docs" / name).read_text())


def test_the_architecture_page_lists_the_import_contracts_layers():
    layers = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"][0]["layers"]
    page = ROOT / "docs" / "architecture.md"
    listed = next(b.code for b in blocks(page) if b.language == "text" and b.code.startswith("jaxllm.convert"))
    assert listed.splitlines() == layers, "copy the layers of pyproject.toml's [tool.importlinter] contract"


def test_the_cluster_page_sizes_a_120b_checkpoint_as_the_planner_counts_it():
    """fp32 params and Adam's two fp32 moments: 12 bytes a parameter, per save, split over 8 hosts."""
    from jaxllm import plan
    from jaxllm.config import load_config

    cfg = load_config(str(ROOT / "configs" / "120b.py"))
    params = plan.param_counts(cfg.model)["total"]
    page = (ROOT / "docs" / "cluster.md").read_text()
    assert f"**{12 * params / 1e12:.2f} TB a save** for the 120B config ({params / 1e9:.1f} billion parameters)" in page
    assert f"{12 * params / 8 / 1e9:.0f} GB a host on 8 nodes" in page
    kept = cfg.checkpoint.keep
    assert f"`checkpoint.keep` ({kept}) of them stay, {kept * 12 * params / 1e12:.1f} TB" in page
