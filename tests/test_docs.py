"""The docs stay true to the code: the configuration reference, the two commands, CI."""

import re
from pathlib import Path

from spawner.reference import render_reference

REPO = Path(__file__).resolve().parent.parent


def test_configuration_reference_is_generated_from_the_traits():
    committed = (REPO / "docs" / "configuration.md").read_text()
    assert committed == render_reference(), "run: python -m spawner.reference > docs/configuration.md"
    for trait in ("db_url", "inventory", "simulated_gpus", "default_limit", "group_limits", "user_limits"):
        assert f"`c.GpuHub.{trait}`" in committed
    assert "`c.Spawner.default_gpus`" in committed and "`c.GpuBroker.lease_seconds`" in committed


def test_readme_quick_start_has_exactly_two_commands_and_ci_runs_the_second():
    readme = (REPO / "README.md").read_text()
    quick = readme.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```\n(.*?)\n```", quick, flags=re.S)
    assert commands == ["scripts/demo", "scripts/test"]
    ci = [
        line
        for line in (REPO / ".ci" / "run").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert ci == ['exec "$(dirname "$0")/../scripts/test" "$@"']
