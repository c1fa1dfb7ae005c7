"""The HTML report: one self-contained page with the plan table, explanation, both charts and the breakdown."""

import base64
import html.parser
import re

import pytest

from orchestrator.report import render_html, write_html
from orchestrator.report._html import _bytes
from orchestrator.simulate import simulate
from tests.orchestrator.simulate._plans import hand_plan, tiny_model
from tests.orchestrator.simulate.test_engine import _plan, _stage

VOID = {"meta", "img", "br", "hr", "link", "input"}


class _Checker(html.parser.HTMLParser):
    """Collects tags, checks that every non-void tag is closed in order, and gathers external references."""

    def __init__(self):
        super().__init__()
        self.stack, self.tags, self.external, self.images = [], [], [], []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        for name, value in attrs:
            if name in ("src", "href") and not value.startswith("data:"):
                self.external.append(value)
            if tag == "img" and name == "src":
                self.images.append(value)
        if tag not in VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes <{self.stack[-1] if self.stack else None}>"
        self.stack.pop()


@pytest.mark.parametrize("with_model", [True, False])
def test_report_is_one_self_contained_page(tmp_path, with_model):
    model = tiny_model()
    plan = hand_plan(model, "1f1b", microbatches=4)
    timeline = simulate(plan, model if with_model else None)
    path = tmp_path / "report.html"
    write_html(plan, timeline, path, title="gpt-tiny on small-mixed")
    page = path.read_text(encoding="utf-8")
    checker = _Checker()
    checker.feed(page)
    checker.close()
    assert checker.stack == []  # every tag closed, in order
    assert not checker.external and "<script" not in page
    assert len(checker.images) == 2  # Gantt and memory
    for src in checker.images:
        assert base64.b64decode(src.removeprefix("data:image/png;base64,"))[:8] == b"\x89PNG\r\n\x1a\n"
    # the plan table: one row per stage, with its devices and both memory figures
    rows = re.findall(r"<tr><td class=l>(\d+)</td><td class=l>([^<]*)</td><td class=l>([^<]*)</td>", page)
    assert [(int(s), devices) for s, _, devices in rows] == [(0, "4 × a (a-0, a-1)"), (1, "4 × b (b-0, b-1)")]
    header = re.findall(r"<th[^>]*>([^<]*)</th>", page.split("<h2>Stages</h2>")[1].split("</tr>")[0])
    body = page.split("<h2>Stages</h2>")[1].split("</table>")[0]
    cells = [re.findall(r"<td[^>]*>([^<]*)</td>", row) for row in body.split("<tr>")[2:]]
    simulated = [row[header.index("memory (simulated)")] for row in cells]
    planned = [row[header.index("memory (plan)")] for row in cells]
    assert planned == [_bytes(x.memory_bytes) for x in plan.stages]
    assert simulated == (planned if with_model else ["—", "—"])  # the simulated peak is the plan's
    # the explanation (Plan.explain) and both breakdowns
    assert "predicted step" in page and "closed form (plan.iteration_s)" in page and "simulated step" in page
    for term in plan.breakdown:
        assert term.removesuffix("_s").replace("_", " ") in page
    assert f"{timeline.rel_diff:+.2%}" in page


def test_report_escapes_text():
    stage = _stage("h<1>/0", f=1.0, b=1.0)
    plan = _plan([stage], 2, "gpipe")
    page = render_html(plan, simulate(plan), title="<b>plan</b> & co")
    assert "&lt;b&gt;plan&lt;/b&gt; &amp; co" in page and "<b>plan</b>" not in page
    assert "(h&lt;1&gt;)" in page  # the host of device h<1>/0, escaped


def test_the_memory_chart_marks_each_stages_device_memory_and_the_headroom():
    import dataclasses

    from orchestrator.cluster import cluster_to_dict
    from orchestrator.report._html import _capacities

    model = tiny_model(memory_bytes=2**33)
    plan = hand_plan(model, "1f1b", microbatches=4)
    assert _capacities(plan) == {}  # no cluster in the plan: no capacity line
    plan = dataclasses.replace(plan, source={"cluster_spec": cluster_to_dict(model.cluster), "memory_headroom": 0.1})
    assert _capacities(plan) == {0: 2**33, 1: 2**33}
    page = render_html(plan, simulate(plan, model))
    assert "dotted: the device&#x27;s memory, of which the plan fills at most 90% (10% kept free as headroom)" in page


def test_the_stage_table_fits_a_1400px_window():
    """No headless browser here: the structure that keeps the page at 1400 px is checked instead. The stage
    table scrolls in its own box, its headers wrap, and its devices cell names hosts, not every device."""
    from orchestrator.report._html import _STYLE, _devices

    refs = tuple(f"a100-{h}/{i}" for h in range(4) for i in range(8))
    assert _devices(refs[:8], "8 × a100") == "8 × a100 (a100-0)"
    assert _devices(refs, "32 × a100") == "32 × a100 (a100-0 … a100-3, 4 hosts)"
    model = tiny_model()
    page = render_html(hand_plan(model, "1f1b", microbatches=4), simulate(hand_plan(model, "1f1b", microbatches=4)))
    stages = page.split("<h2>Stages</h2>")[1]
    assert stages.lstrip().startswith('<div class="wide"><table>')
    assert ".wide { max-width: 100%; overflow-x: auto; }" in _STYLE and "th { white-space: normal;" in _STYLE
    body = stages.split("</table>")[0]
    assert max(len(cell) for cell in re.findall(r"<td[^>]*>([^<]*)</td>", body)) <= 32
