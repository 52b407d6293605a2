"""The records that cross rooms import nothing but the standard library, and reading a study does not load the client."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _modules_after(code: str, *flags: str) -> set[str]:
    out = subprocess.run([sys.executable, *flags, "-c", code + "\nimport sys; print(' '.join(sys.modules))"],
                         capture_output=True, text=True, check=True, cwd=ROOT,
                         env={"PYTHONPATH": str(ROOT), "PATH": ""})
    return set(out.stdout.split())


def test_records_import_only_the_standard_library():
    # -S: no site-packages at all, so a third-party import would fail outright
    loaded = _modules_after("import tuner.records, tuner.load.plan", "-S")
    third_party = {m.split(".")[0] for m in loaded} - set(sys.stdlib_module_names) - {"tuner", "__main__"}
    assert third_party == set()


def test_reading_a_study_file_loads_no_client():
    loaded = _modules_after("import tuner.config\n"
                            "tuner.config.load_study('tuner/studies/demo.toml')")
    assert "aiohttp" not in loaded and "tuner.load.client" not in loaded


def test_old_homes_still_export_the_records():
    from tuner.run import process, measure
    from tuner.load import client, metrics
    from tuner import records
    from tuner.search import study

    assert process.LaunchSpec is records.LaunchSpec and process.Capacity is records.Capacity
    assert client.Workload is records.Workload and client.PhaseResult is records.PhaseResult
    assert metrics.LoadMetrics is records.LoadMetrics and measure.TrialOutcome is records.TrialOutcome
    assert study.Platform is records.Platform
