"""The `gpuhub` console script, run as an admin would, against a real ledger file."""

import json
import re
import subprocess
import sys
from datetime import datetime
from pathlib import Path

import pytest
from sqlalchemy import text

from spawner.cli.output import format_table
from spawner.cli.usage import parse_when
from spawner.ledger import Ledger, db
from spawner.policy.limits import Limit
from spawner.spawners.inventory import parse_simulated

GPUHUB = str(Path(sys.executable).with_name("gpuhub"))
CONFIG = """
c = get_config()
c.GpuHub.inventory = "simulated"
c.GpuHub.simulated_gpus = [
    {"node": "n1", "count": 2, "model": "A100"},
    {"node": "n2", "count": 1, "model": "V100"},
]
c.GpuHub.group_limits = {"students": 2}
"""


@pytest.fixture
def hubdir(tmp_path):
    (tmp_path / "jupyterhub_config.py").write_text(CONFIG)
    return tmp_path


def gpuhub(cwd, *args, ok=True):
    r = subprocess.run([GPUHUB, *args], cwd=cwd, capture_output=True, text=True)
    if ok:
        assert r.returncode == 0, r.stderr
    return r


def test_limits_set_show_unset(hubdir):
    gpuhub(hubdir, "limits", "set", "--default", "1")
    gpuhub(hubdir, "limits", "set", "--group", "students", "3")
    gpuhub(
        hubdir, "limits", "set", "--user", "alice", "unlimited", "--gpu-hours", "50", "--window-hours", "24"
    )
    out = gpuhub(hubdir, "limits", "show").stdout.splitlines()
    assert out[2].split() == ["default", "*", "1", "-", "ledger"]
    assert out[3].split() == ["group", "students", "3", "-", "ledger"]
    assert out[4].split() == ["user", "alice", "unlimited", "50", "per", "24", "h", "ledger"]
    gpuhub(hubdir, "limits", "unset", "--group", "students")
    out = gpuhub(hubdir, "limits", "show").stdout
    assert "students  2" in out and "config" in out  # back to c.GpuHub.group_limits
    assert gpuhub(hubdir, "limits", "unset", "--group", "students", ok=False).returncode == 1
    rules = Ledger(f"sqlite:///{hubdir / 'gpuhub.sqlite'}").rules()
    assert rules.users["alice"].max_gpus is None and rules.users["alice"].gpu_hours == 50


@pytest.mark.parametrize(
    "args, words",
    [
        (["limits", "set", "--user", "bob", "lots"], "from 0 to 1000000 or 'unlimited'; got 'lots'"),
        (["limits", "set", "--user", "bob", "-1"], "a limit must be a whole number from 0 to 1000000"),
        (["limits", "set", "--user", "bob", "1", "--window-hours", "0"], "from 0.01 to 876600 hours; got 0"),
        (["usage", "--since", "yesterday"], "--since must be a date (2026-11-01)"),
        # what a fuzz of the demo found (issue 12): each was a traceback or a broken user
        (["limits", "set", "--default", "\u00b2"], "a limit must be a whole number"),
        (["limits", "set", "--default", "\u0663"], "a limit must be a whole number"),
        (["limits", "set", "--default", "\uff11"], "a limit must be a whole number"),
        (["limits", "set", "--default", "9" * 30], "from 0 to 1000000"),
        (["limits", "set", "--user", "bob", "1000001"], "from 0 to 1000000 or 'unlimited'; got '1000001'"),
        (
            ["limits", "set", "--user", "bob", "2", "--window-hours", "inf"],
            "argument --window-hours: must be a number",
        ),
        (["limits", "set", "--user", "bob", "2", "--window-hours", "1e10"], "from 0.01 to 876600 hours"),
        (
            ["limits", "set", "--user", "bob", "2", "--gpu-hours", "nan"],
            "argument --gpu-hours: must be a number",
        ),
        (["limits", "set", "--user", "bob", "2", "--gpu-hours", "1" + "0" * 400], "from 0 to 1e+12"),
        (["limits", "set", "--user", "bo,b", "2"], "--user must be a user or group name"),
        (["limits", "set", "--group", "a=b", "2"], "--group must be a user or group name"),
        (["limits", "set", "--group", " ml", "2"], "no space at either end"),
        (["--db-url", "postgresql://u:secret@h:notaport/db", "gpus"], "cannot open the ledger"),
        (["usage", "--since", "0001-01-01T00:00+01:00"], "from 1970-01-01 to 3000-01-01"),
        (["usage", "--since", "9999-12-31T23:59-01:00"], "from 1970-01-01 to 3000-01-01"),
        (["usage", "--since", "99999999d"], "--since must be a date"),
        (["--config", ".", "gpus"], "no config file at ."),
        (["--db-url", "sqlite:////nonexistent/dir/x.sqlite", "gpus"], "cannot open the ledger at sqlite:"),
        (["--db-url", "foo://x", "gpus"], "cannot open the ledger at foo://x"),
        (["--db-url", "not a url", "gpus"], "check --db-url"),
        (["usage", "--since", "1d", "--until", "2d"], "--until must be after --since"),
        (["--config", "nope.py", "gpus"], "no config file at nope.py"),
    ],
)
def test_bad_input_is_a_clear_error(hubdir, args, words):
    r = gpuhub(hubdir, *args, ok=False)
    assert r.returncode == 2 and words in r.stderr and "Traceback" not in r.stderr


def test_gpus_and_usage_show_holders(hubdir):
    ledger = Ledger(f"sqlite:///{hubdir / 'gpuhub.sqlite'}")
    ledger.sync_inventory(
        parse_simulated(
            [{"node": "n1", "count": 2, "model": "A100"}, {"node": "n2", "count": 1, "model": "V100"}]
        )
    )
    ledger.set_limit("user", "carol", Limit(max_gpus=2))
    a = ledger.allocate("carol", [], 2, server_name="big")
    ledger.mark_running(a.id, "4242")
    out = gpuhub(hubdir, "gpus").stdout.splitlines()
    assert [line.split()[:4] for line in out[2:]] == [
        ["n1", "0", "A100", "carol"],
        ["n1", "1", "A100", "carol"],
        ["n2", "0", "V100", "free"],
    ]
    assert f"server big (#{a.id})" in out[2]
    usage = gpuhub(hubdir, "usage", "--user", "carol").stdout
    assert usage.splitlines()[-1].split()[0] == "carol"


def test_global_options_go_before_or_after_the_command_and_json_matches_the_ledger(hubdir, tmp_path_factory):
    url = f"sqlite:///{hubdir / 'gpuhub.sqlite'}"
    ledger = Ledger(url)
    ledger.sync_inventory(parse_simulated([{"node": "n1", "count": 2, "model": "A100"}]))
    ledger.set_limit("group", "students", Limit(max_gpus=2, gpu_hours=10, window_hours=24))
    a = ledger.allocate("carol", ["students"], 1, server_name="")
    ledger.mark_running(a.id, "4242")
    elsewhere = tmp_path_factory.mktemp("elsewhere")  # no jupyterhub_config.py here
    cfg = str(hubdir / "jupyterhub_config.py")

    before = gpuhub(elsewhere, "--db-url", url, "gpus", "--json").stdout
    after = gpuhub(elsewhere, "gpus", "--db-url", url, "--json").stdout
    top = gpuhub(elsewhere, "--json", "--db-url", url, "gpus").stdout
    assert before == after == top
    rows = json.loads(after)
    assert [(r["node"], r["index"], r["model"], r["present"]) for r in rows] == [
        ("n1", 0, "A100", True),
        ("n1", 1, "A100", True),
    ]
    [held] = [r for r in rows if r["holder"]]
    assert held["holder"] == {
        "user": "carol",
        "allocation_id": a.id,
        "purpose": "server",
        "server_name": "",
        "since": ledger.get(a.id).started.strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    assert {st.gpu.label for st in ledger.gpu_table() if st.holder} == {f"n1:{held['index']}"}

    limits = json.loads(gpuhub(elsewhere, "limits", "show", "--json", "-f", cfg, "--db-url", url).stdout)
    assert {
        "scope": "group",
        "name": "students",
        "origin": "ledger",
        "max_gpus": 2,
        "gpu_hours": 10.0,
        "window_hours": 24.0,
    } in limits["limits"]
    assert limits["ignored"] == []
    usage = json.loads(gpuhub(elsewhere, "usage", "--since", "1d", "--db-url", url, "--json").stdout)
    assert set(usage) == {"since", "until", "gpu_hours"} and set(usage["gpu_hours"]) == {"carol"}
    # a change through the options after the command lands in that ledger
    gpuhub(elsewhere, "limits", "set", "--user", "dave", "3", "--db-url", url)
    assert ledger.rules().users["dave"].max_gpus == 3


def test_a_group_name_with_a_space_and_a_url_with_a_password(hubdir):
    gpuhub(hubdir, "limits", "set", "--group", "ml team", "3")
    assert "ml team" in gpuhub(hubdir, "limits", "show").stdout
    gpuhub(hubdir, "limits", "unset", "--group", "ml team")
    r = gpuhub(hubdir, "--db-url", "postgresql://u:secret@h:notaport/db", "gpus", ok=False)
    assert r.returncode == 2 and "secret" not in r.stderr and "Traceback" not in r.stderr


def test_help_lists_the_exit_codes():
    r = subprocess.run([GPUHUB, "--help"], capture_output=True, text=True)
    assert "exit codes:" in r.stdout and "2  bad input or a failure" in r.stdout
    r = subprocess.run([GPUHUB, "limits", "unset", "--help"], capture_output=True, text=True)
    assert "1  nothing to change" in r.stdout


def test_db_upgrade_and_behind_schema(hubdir):
    url = f"sqlite:///{hubdir / 'old.sqlite'}"
    assert f"is at schema {db.head_revision()}" in gpuhub(hubdir, "--db-url", url, "db", "upgrade").stdout
    led = Ledger(url)
    with led.engine.begin() as conn:
        conn.execute(text("UPDATE alembic_version SET version_num = 'ffff'"))
    r = gpuhub(hubdir, "--db-url", url, "limits", "show", ok=False)
    assert r.returncode == 2 and "newer than this gpuhub knows" in r.stderr


def test_format_table_and_parse_when():
    assert format_table(("A", "BB"), [(1, None)]) == "A  BB\n-  --\n1"
    now = datetime(2026, 11, 29, 12, 0)
    assert parse_when("2d", now) == datetime(2026, 11, 27, 12, 0)
    assert parse_when("6h", now) == datetime(2026, 11, 29, 6, 0)
    assert parse_when("2026-11-01", now) == datetime(2026, 11, 1)


def test_slurm_script_preview_uses_the_hubs_settings_and_template(tmp_path):
    (tmp_path / "jupyterhub_config.py").write_text(
        "c.GpuSlurmSpawner.cpus_per_gpu = 3\n"
        'c.GpuSlurmSpawner.extra_directives = ["--qos=interactive"]\n'
        'c.GpuSlurmSpawner.req_runtime = "2:00:00"\n'
        'c.Spawner.cmd = ["/opt/env/bin/jupyterhub-singleuser"]\n'
        'c.GpuSlurmSpawner.batchspawner_singleuser_cmd = "/opt/env/bin/batchspawner-singleuser"\n'
    )
    text = gpuhub(tmp_path, "slurm", "script", "--user", "nobody", "--gpus", "2", "--partition", "p1").stdout
    assert text.startswith("#!/bin/bash\n")
    for line in (
        "#SBATCH --gres=gpu:2", "#SBATCH --partition=p1", "#SBATCH --cpus-per-task=6",
        "#SBATCH --time=2:00:00", "#SBATCH --qos=interactive", "#SBATCH --job-name=gpuhub-server",
        "exec /opt/env/bin/batchspawner-singleuser /opt/env/bin/jupyterhub-singleuser",
    ):  # fmt: skip
        assert line in text.splitlines(), line
    assert "JUPYTERHUB_API_TOKEN" in text and "CUDA_VISIBLE_DEVICES" not in text  # names only, Slurm's GPUs
    # an admin's own template is what gets rendered
    (tmp_path / "t.sbatch").write_text("#!/bin/sh\n#SBATCH --gres={{ gres }}\n{{ command }}\n")
    with open(tmp_path / "jupyterhub_config.py", "a") as f:
        f.write(f"c.GpuSlurmSpawner.batch_script = open({str(tmp_path / 't.sbatch')!r}).read()\n")
    text = gpuhub(
        tmp_path, "slurm", "script", "--user", "nobody", "--gpus", "1", "--gpu-model", "a100"
    ).stdout
    assert text.splitlines() == [
        "#!/bin/sh",
        "#SBATCH --gres=gpu:a100:1",
        "/opt/env/bin/batchspawner-singleuser /opt/env/bin/jupyterhub-singleuser",
    ]
    # a value that cannot go on an #SBATCH line is an error that says so
    r = gpuhub(tmp_path, "slurm", "script", "--user", "nobody", "--partition", "a b", ok=False)
    assert r.returncode == 2 and "partition must be one word" in r.stderr


def test_queue_show_cancel_and_front(hubdir):
    """`gpuhub queue`: the waiting requests in their order, the same as the ledger's; cancel and
    front change them; an entry that no longer waits is refused with exit code 2."""
    from spawner.ledger import QueueSettings

    url = f"sqlite:///{hubdir / 'gpuhub.sqlite'}"
    from spawner.policy.limits import LimitRules

    ledger = Ledger(
        url, config_rules=LimitRules(default=Limit(2)), queue=QueueSettings(keepalive_seconds=3600)
    )
    ledger.sync_inventory(parse_simulated([{"node": "n1", "count": 2, "model": "A100"}]))
    ledger.allocate("alice", ["students"], 2, purpose="server")
    bob = ledger.request("bob", ["students"], 1, purpose="distributed", lease_seconds=60).entry
    carol = ledger.request("carol", ["students"], 2, purpose="distributed", lease_seconds=60).entry
    assert [q.id for q in ledger.queue()] == [bob.id, carol.id]

    out = gpuhub(hubdir, "queue", "show").stdout.splitlines()
    assert [line.split()[:3] for line in out[2:]] == [
        ["1", str(bob.id), "bob"],
        ["2", str(carol.id), "carol"],
    ]
    shown = json.loads(gpuhub(hubdir, "queue", "show", "--json").stdout)
    assert [(q["user"], q["position"]) for q in shown] == [("bob", 1), ("carol", 2)]

    assert (
        f"queue entry {carol.id} (carol) goes ahead" in gpuhub(hubdir, "queue", "front", str(carol.id)).stdout
    )
    assert [q.user for q in ledger.queue()] == ["carol", "bob"]
    assert "cancelled" in gpuhub(hubdir, "queue", "cancel", str(bob.id)).stdout
    assert [q.user for q in ledger.queue()] == ["carol"]
    assert ledger.queue_entry(bob.id).end_reason.startswith("cancelled by an admin")

    again = gpuhub(hubdir, "queue", "cancel", str(bob.id), ok=False)
    assert again.returncode == 2 and "no longer waits (cancelled by an admin" in again.stderr
    assert gpuhub(hubdir, "queue", "front", "99", ok=False).returncode == 2
    assert gpuhub(hubdir, "queue", "cancel", "x", ok=False).returncode == 2  # argparse: a whole number
    ledger.leave_queue(carol.id)
    assert gpuhub(hubdir, "queue", "show").stdout.strip() == "nobody waits for GPUs"


REPO = Path(__file__).resolve().parent.parent


def demo_state_dir(path: Path, *extras: Path) -> Path:
    """A state directory as scripts/demo leaves it: its jupyterhub_config.py loads the demo's
    config, then ``extras`` (written by the demo's own helper, run as scripts/demo runs it)."""
    path.mkdir()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "spawner.spawners.demo",
            "config",
            str(REPO / "hub_config" / "demo.py"),
            *map(str, extras),
        ],
        cwd=path,
        check=True,
    )
    return path


def test_in_the_demos_state_directory_the_cli_reads_the_demos_config_and_says_so(tmp_path):
    state = demo_state_dir(tmp_path / "demo-state")
    r = gpuhub(state, "limits", "show")
    rows = [line.split() for line in r.stdout.splitlines()[2:]]
    assert rows == [
        ["default", "*", "1", "-", "config"],
        ["group", "students", "2", "-", "config"],
        ["user", "alice", "3", "-", "config"],
    ], r.stdout
    assert r.stderr == f"gpuhub: read {state / 'jupyterhub_config.py'}\n"
    # from anywhere with --config: the same limits, and the same ledger (the state directory's)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    gpuhub(elsewhere, "--config", str(state / "jupyterhub_config.py"), "limits", "set", "--user", "dave", "2")
    assert not (elsewhere / "gpuhub.sqlite").exists()
    shown = gpuhub(state, "limits", "show").stdout
    assert ["user", "dave", "2", "-", "ledger"] in [line.split() for line in shown.splitlines()]
    # with no config anywhere: it says so, and what it shows instead
    r = gpuhub(elsewhere, "limits", "show")
    assert [line.split() for line in r.stdout.splitlines()[2:]] == [["default", "*", "1", "-", "config"]]
    assert r.stderr.startswith("gpuhub: no hub config read (no ./jupyterhub_config.py here, no --config)")
    assert len(r.stderr.splitlines()) == 1


def test_an_extra_config_of_the_demo_is_read_after_its_own(tmp_path):
    extra = tmp_path / "extra.py"
    extra.write_text('c = get_config()\nc.GpuHub.group_limits = {"students": 1, "staff": 4}\n')
    state = demo_state_dir(tmp_path / "demo-state", extra)
    rows = [line.split() for line in gpuhub(state, "limits", "show").stdout.splitlines()[2:]]
    assert ["group", "students", "1", "-", "config"] in rows and [
        "group",
        "staff",
        "4",
        "-",
        "config",
    ] in rows
    assert ["user", "alice", "3", "-", "config"] in rows  # the demo's own, kept
    extra.unlink()  # gone since: an error that names it, not a silent default
    r = gpuhub(state, "limits", "show", ok=False)
    assert r.returncode == 2 and f"no config file at {extra}" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize(
    "args",
    [["gpus"], ["usage"], ["queue", "show"], ["limits", "show"], ["db", "upgrade"], ["slurm", "priority"]],
)
def test_every_command_that_reads_the_settings_says_which_config(hubdir, tmp_path_factory, args):
    r = gpuhub(hubdir, *args)
    assert r.stderr.splitlines()[0] == f"gpuhub: read {hubdir / 'jupyterhub_config.py'}", r.stderr
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    r = gpuhub(elsewhere, "--db-url", f"sqlite:///{hubdir / 'gpuhub.sqlite'}", *args)
    assert r.stderr.splitlines()[0].startswith("gpuhub: no hub config read"), r.stderr


def test_counts_and_times_are_written_for_people(hubdir):
    """ "1 GPU", never "1 GPUs"; UTC stamps in tables, ISO only in --json."""
    assert gpuhub(hubdir, "limits", "set", "--group", "students", "1").stdout == (
        "group limit for students: 1 GPU, no GPU-hours quota\n"
    )
    assert gpuhub(hubdir, "limits", "set", "--user", "bob", "3", "--gpu-hours", "5").stdout == (
        "user limit for bob: 3 GPUs, 5 GPU-hours per 168 h\n"
    )
    from spawner.ledger import QueueSettings
    from spawner.policy.limits import LimitRules

    ledger = Ledger(
        f"sqlite:///{hubdir / 'gpuhub.sqlite'}",
        config_rules=LimitRules(default=Limit(2)),
        queue=QueueSettings(keepalive_seconds=3600),
    )
    ledger.sync_inventory(parse_simulated([{"node": "n1", "count": 2, "model": "A100"}]))
    a = ledger.allocate("carol", [], 2)
    since = ledger.get(a.id).created
    out = gpuhub(hubdir, "gpus").stdout
    assert f" {since:%Y-%m-%d %H:%M:%S} UTC " in out and not re.search(r"\dT\d|\dZ\b", out)
    usage = gpuhub(hubdir, "usage", "--since", "2026-11-01").stdout.splitlines()[0]
    assert usage.startswith("GPU-hours from 2026-11-01 00:00:00 UTC to ") and usage.endswith(" UTC")
    entry = ledger.request("dave", [], 2, purpose="distributed", lease_seconds=60).entry
    assert "(dave, 2 GPUs)" in gpuhub(hubdir, "queue", "cancel", str(entry.id)).stdout


def test_usage_with_energy_shows_kwh_idle_meter_cost_and_what_was_not_measured(hubdir):
    from spawner.policy.energy import Share

    (hubdir / "jupyterhub_config.py").write_text(
        CONFIG + '\nc.GpuHub.pue = 1.5\nc.GpuHub.energy_price = 0.2\nc.GpuHub.energy_currency = "EUR"\n'
    )
    ledger = Ledger(f"sqlite:///{hubdir / 'gpuhub.sqlite'}")
    ledger.sync_inventory(parse_simulated([{"node": "n1", "count": 2, "model": "A100"}]))
    a = ledger.allocate("carol", [], 1)
    today = ledger.clock().date()
    # 2 kWh at the GPUs, a quarter of it idle; 0.5 GPU-hours not measured
    ledger.add_energy([Share(a.id, today, 2 * 3.6e6, 0.5 * 3.6e6, 3600.0, 1800.0, 900.0)])
    out = gpuhub(hubdir, "usage", "--since", "1d", "--energy").stdout.splitlines()
    assert "PUE 1.5" in out[0]
    head = out[1].split()
    assert head[:5] == ["USER", "GPU-HOURS", "KWH", "IDLE", "METER"] and "EUR" in head
    row = out[-1].split()
    assert row[0] == "carol" and row[2:7] == ["2.000", "25", "%", "3.000", "0.60"] and row[7] == "0.50"
    doc = json.loads(gpuhub(hubdir, "usage", "--since", "1d", "--energy", "--json").stdout)
    assert doc["energy"]["carol"]["cost"] == pytest.approx(0.6) and doc["costing"]["currency"] == "EUR"
    # a bad facility setting is refused with the setting named
    (hubdir / "jupyterhub_config.py").write_text(CONFIG + "\nc.GpuHub.pue = 0.5\n")
    r = gpuhub(hubdir, "usage", "--energy", ok=False)
    assert r.returncode == 2 and "c.GpuHub.pue must be from 1 to 5" in r.stderr
    assert "Traceback" not in r.stderr
