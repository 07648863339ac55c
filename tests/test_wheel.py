"""The path a real admin takes: build the wheel, install it into a clean environment, and run
a hub from ``hub_config/`` with that install, which spawns a GPU server whose kernel runs
``%gpus``.

The clean environment gets gpuhub only from the wheel (``pip install --no-deps``). Its
dependencies (JupyterHub, torch, ...) are this test environment's, reached through a plain
path line in a ``.pth`` file: that adds the directory without running its ``.pth`` hooks, so
the checkout's editable install is not visible there.
"""

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

from spawner.ledger import Ledger

from .hubtools import REPO, Hub
from .test_distributed_hub import run

pytestmark = pytest.mark.hub

SPEC = "share/jupyter/kernels/python3-gpus/kernel.json"
LAB_DEFAULTS = "share/jupyter/lab/settings/overrides.d/gpuhub.json"  # no news prompt in JupyterLab
VENDOR = "spawner/broker/static/vendor"
LAB_BUILD = "build/labextension/gpuhub-lab"  # JupyterLab's GPU panel, built by scripts/setup
LABEXT = "share/jupyter/labextensions/gpuhub-lab"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """The wheel built from the repository's tracked files (what a clone holds) after
    scripts/setup, as a release build would be."""
    src = tmp_path_factory.mktemp("src")
    files = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True)
    # plus what scripts/setup adds from npm before it packages (chart.js for the pages, the
    # built JupyterLab extension)
    vendor = [str(p.relative_to(REPO)) for p in (REPO / VENDOR).glob("*")]
    assert vendor, "scripts/setup puts chart.js in spawner/broker/static/vendor"
    lab = [str(p.relative_to(REPO)) for p in (REPO / LAB_BUILD).rglob("*") if p.is_file()]
    assert any(name.endswith("package.json") for name in lab), "scripts/setup builds labextension/"
    for name in [*files.stdout.splitlines(), *vendor, *lab]:
        if (REPO / name).is_file():
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, src / name)
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            str(src),
        ],
        check=True,
        capture_output=True,
    )
    [whl] = out.glob("jupyterhub_gpuhub-*.whl")
    return whl


def test_the_wheel_holds_two_packages_the_kernel_spec_and_the_lab_extension_as_data(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names}
    data = [n for n in names if ".data/" in n]
    assert top == {"spawner", "gpu_magics", *(t for t in top if t.startswith("jupyterhub_gpuhub-0"))}
    assert not [n for n in names if n.startswith(("kernels/", "tests/", "hub_config/"))]
    found = sorted(n.split(".data/data/", 1)[1] for n in data)
    logos = [f"share/jupyter/kernels/python3-gpus/logo-{n}" for n in ("32x32.png", "64x64.png", "svg.svg")]
    configs = [
        "etc/jupyter/jupyter_server_config.d/gpuhub-lab.json",
        "etc/jupyter/labconfig/page_config.json",
    ]
    lab = [n for n in found if n.startswith(f"{LABEXT}/")]
    assert sorted(set(found) - set(lab)) == sorted([SPEC, LAB_DEFAULTS, *logos, *configs])
    assert f"{LABEXT}/package.json" in lab and f"{LABEXT}/install.json" in lab
    assert any(re.fullmatch(rf"{LABEXT}/static/remoteEntry\.\w+\.js", n) for n in lab), lab
    # the pages' templates: the spawn-pending page's heading, the Services menu's names
    assert "spawner/spawners/templates/spawn_pending.html" in names
    assert "spawner/broker/templates/hub/page.html" in names
    assert "spawner/broker/openapi.yaml" in names and "spawner/ledger/migrations/env.py" in names
    assert f"{VENDOR}/chart.umd.min.js" in names and f"{VENDOR}/chart.js.LICENSE.md" in names


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A clean environment with the wheel installed; returns its python."""
    env = tmp_path_factory.mktemp("env") / "venv"
    subprocess.run([sys._base_executable, "-m", "venv", "--without-pip", str(env)], check=True)
    python = env / "bin" / "python"
    site = Path(
        subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    (site / "gpuhub-test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps", str(wheel)],
        check=True,
        capture_output=True,
    )
    # the dependencies' own switches, as their installs would write them: JupyterLab's server
    # extension (the wheel's own gpuhub-lab.json is in place already)
    config = env / "etc" / "jupyter" / "jupyter_server_config.d"
    shutil.copy(Path(sys.prefix) / "etc" / "jupyter" / "jupyter_server_config.d" / "jupyterlab.json", config)
    return python


def test_the_installed_kernel_is_there_with_no_command(installed, tmp_path):
    env = dict(os.environ, JUPYTER_DATA_DIR=str(tmp_path / "data"), HOME=str(tmp_path))
    code = (
        "import spawner, gpu_magics, importlib.util as u;"
        "from jupyter_client.kernelspec import KernelSpecManager as K;"
        "print(spawner.__file__); print(gpu_magics.__file__); print(u.find_spec('kernels'));"
        "print(K().get_kernel_spec('python3-gpus').resource_dir)"
    )
    out = subprocess.run([str(installed), "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    spawner_file, magics_file, kernels_spec, resource = out.stdout.split("\n")[:4]
    prefix = str(installed.parent.parent)
    assert spawner_file.startswith(prefix) and magics_file.startswith(prefix)
    assert kernels_spec == "None"  # no top-level package named kernels
    assert resource == f"{prefix}/share/jupyter/kernels/python3-gpus"
    cli = subprocess.run([str(installed.with_name("gpuhub")), "--help"], capture_output=True, text=True)
    assert cli.returncode == 0 and "exit codes:" in cli.stdout
    # `gpuhub kernel install` stays, for other places
    other = tmp_path / "other"
    r = subprocess.run(
        [str(installed.with_name("gpuhub")), "kernel", "install", "--prefix", str(other)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert (other / SPEC).read_text() == (Path(prefix) / SPEC).read_text()


def test_a_hub_from_the_installed_package_spawns_a_gpu_server_that_runs_gpus(installed, tmp_path):
    from jupyterlab.commands import get_app_dir

    # JupyterLab's application (its data files) is this test environment's, as its Python
    # packages are; the extensions and the page config are the clean environment's own
    app = f"c.Spawner.environment = {{**c.Spawner.environment, 'JUPYTERLAB_DIR': {get_app_dir()!r}}}"
    hub = Hub(tmp_path, python=installed, extra_config=app).start()
    ledger = Ledger(hub.ledger_url)
    try:
        hub.wait_for_broker()
        chart = hub.api_url_request("GET", "/services/gpuhub/static/vendor/chart.umd.min.js")
        assert chart.status_code == 200 and "Chart.js v" in chart.text[:200]  # the pages' chart, installed
        assert hub.spawn("alice", {"gpus": 1}).status_code in (201, 202)
        hub.wait_ready("alice")
        [alloc] = ledger.active(user="alice")
        env = hub.server_env("alice")
        assert env["GPUHUB_ALLOCATION_ID"] == str(alloc.id)
        kc = hub.server_kernel("alice")
        status, out = run(kc, "import gpu_magics, sys; print(gpu_magics.__file__, sys.prefix)")
        assert status == "ok" and out.split() == [
            str(
                installed.parent.parent
                / "lib"
                / f"python{sys.version_info[0]}.{sys.version_info[1]}"
                / "site-packages"
                / "gpu_magics"
                / "__init__.py"
            ),
            str(installed.parent.parent),
        ], out
        status, out = run(kc, "%gpus")
        assert status == "ok" and f"Server allocation #{alloc.id}: 1 GPU," in out, out
        kc.stop_channels()
        # JupyterLab's GPU panel: listed and enabled, its files served by alice's server, its
        # server extension answering with her GPUs; ipyparallel's lab extension is off
        listed = subprocess.run(
            [str(installed), "-m", "jupyterlab.labextensions", "list"],
            capture_output=True,
            text=True,
            check=True,
        )
        text = listed.stdout + listed.stderr
        assert re.search(r"gpuhub-lab v\S+ .*enabled.*OK.*\(python, jupyterhub-gpuhub\)", text), text
        alice = hub.login("alice")
        lab = alice.get(f"{hub.url}/user/alice/lab")
        assert lab.status_code == 200 and '"gpuhub-lab"' in lab.text  # in the page's federated list
        config = json.loads(re.search(r'id="jupyter-config-data"[^>]*>(.*?)</script>', lab.text, re.S)[1])
        assert "ipyparallel-labextension" in config["disabledExtensions"], config["disabledExtensions"]
        [entry] = (installed.parent.parent / LABEXT / "static").glob("remoteEntry.*.js")
        served = alice.get(f"{hub.url}/user/alice/lab/extensions/gpuhub-lab/static/{entry.name}")
        assert served.status_code == 200 and served.content == entry.read_bytes(), (
            served.status_code,
            config.get("fullLabextensionsUrl"),
            [e for e in config.get("federated_extensions", []) if e["name"] == "gpuhub-lab"],
        )
        st = alice.get(f"{hub.url}/user/alice/gpuhub/api/status").json()
        assert st["available"] and st["server"]["id"] == alloc.id, st
        hub.stop_server("alice")
        assert ledger.active() == []
    finally:
        hub.stop()
        ledger.close()
