"""run-demo.sh's training learns: its own flags (read from the script), shortened from 25 epochs to DEMO_EPOCHS, on
2 CPU processes with gloo, must reach an mAP50 that every x86-64 CPU reaches by then (the demo's full run ends
above 0.5: docs/demo.md). It draws the prediction picture the script's closing message names."""
import csv
import re
import shlex

import pytest

from testsupport.jobs import run, torchrun_cmd
from testsupport.trees import KIT

pytestmark = pytest.mark.timeout(900)
DEMO_EPOCHS = 10
FLOOR_MAP50 = 0.1  # well below what 10 epochs of the same schedule reach on a CPU: a floor, not a benchmark


def demo_training() -> list:
    """The training flags of run-demo.sh: its `train=(...)` array."""
    script = (KIT / 'run-demo.sh').read_text()
    return shlex.split(re.search(r'^train=\((.*?)\)$', script, re.M | re.S).group(1))


def shortened(flags: list, epochs: int) -> list:
    at = flags.index('--epochs')
    return [*flags[:at + 1], str(epochs), *flags[at + 2:]]


def final_map50(run_dir) -> float:
    with open(run_dir / 'results.csv') as f:
        return float(list(csv.DictReader(f, skipinitialspace=True))[-1]['metrics/mAP_0.5'])


def test_the_demo_trains_ddp_train_dual_on_its_own_data_and_only_its_epochs_are_shortened():
    flags = demo_training()
    assert flags[0] == 'ddp_train_dual.py' and '--data' not in flags  # the embedded default, as the demo
    short = shortened(flags, DEMO_EPOCHS)
    at = flags.index('--epochs')
    assert short[at + 1] == str(DEMO_EPOCHS) and short[:at + 1] + short[at + 2:] == flags[:at + 1] + flags[at + 2:]


@pytest.mark.slow
def test_a_shortened_demo_learns_and_draws_its_predictions(patched_tree, tmp_path):
    flags = demo_training()
    assert flags[0] == 'ddp_train_dual.py' and '--data' not in flags  # the embedded default, as the demo
    cmd = torchrun_cmd(2, *shortened(flags, DEMO_EPOCHS), '--device', 'cpu', '--project', tmp_path / 'runs',
                       '--name', 'exp')
    result = run(cmd, patched_tree, timeout=800)
    assert result.returncode == 0, result.stderr[-4000:]
    run_dir = tmp_path / 'runs' / 'exp'
    assert final_map50(run_dir) >= FLOOR_MAP50, (run_dir / 'results.csv').read_text()
    assert (run_dir / 'val_batch0_pred.jpg').is_file() and (run_dir / 'results.png').is_file()
