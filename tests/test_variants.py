"""experiments/variants.py: a variant is one record. Added in one entry (in a copy of the registry
of the test's own), it reaches campaign.py --list, a one-update --run with its engine option in
args.json, and results.py's tables; a run folder whose name does not parse is refused by name;
every record's args.json signature is its own."""
import json
import os
import shutil
import subprocess
import sys

import pytest

import results
import variants
import warm_start
from conftest import ROOT, tiny_args

NEW = 'Variant("fp16-rotary-torch", ("--dtype", "fp16"), rotary_torch=True, color="tab:gray")'
# A process whose registry has one entry more, then campaign.py's main
LAUNCH = f"""import sys
sys.path[:0] = [{os.path.join(ROOT, "experiments")!r}]
import variants
variants.add(variants.{NEW})
import campaign
campaign.main(sys.argv[1:])
"""


def launch(tmp_path, *argv):
    script = tmp_path / "launch.py"
    script.write_text(LAUNCH)
    return subprocess.run([sys.executable, str(script), *argv], cwd=ROOT, capture_output=True,
                          text=True)


def test_a_variant_added_in_one_entry_reaches_the_list_a_run_and_the_tables(warm_dir, tmp_path,
                                                                             monkeypatch, capsys):
    listed = launch(tmp_path, "--list", "--arms", "grpo", "--variants", "fp16", "fp16-rotary-torch",
                    "--seeds", "0", "--results", str(tmp_path / "results"))
    assert listed.returncode == 0, listed.stderr
    assert "todo  grpo-fp16-rotary-torch-s0" in listed.stdout, listed.stdout
    args = tiny_args(warm_dir, "--out", os.path.join(warm_dir, "campaign-source"))
    init = warm_start.warm_start(warm_start.model_config(args.n_items, args.max_new_tokens),
                                 args.n_items, 0, "cpu")
    run = tmp_path / "results" / "grpo-fp16-rotary-torch-s0"
    done = launch(tmp_path, "--run", "--stop-after", "1", "--variant", "fp16-rotary-torch", "--",
                  "--dtype", "fp16", "--init", init, "--steps", "2", "--batch-size", "8",
                  "--group-size", "4", "--out", str(run))
    assert done.returncode == 0, done.stderr[-2000:]
    recorded = json.loads((run / "args.json").read_text())
    assert recorded["engine_custom_ops"] == ["-rotary_embedding"] and recorded["stop_after"] == 1
    shutil.rmtree(run / "hf")
    for f in ("checkpoint.pt",):
        os.remove(run / f)
    (run / "heldout.json").write_text(json.dumps({"accuracy": 0.5}))
    monkeypatch.setattr(variants, "VARIANTS", dict(variants.VARIANTS))
    variants.add(eval("variants." + NEW))  # the same entry, in this process's copy
    monkeypatch.setattr(results, "COLORS", {**results.COLORS, "fp16-rotary-torch": "tab:gray"})
    monkeypatch.setattr(results, "ORDER", [*results.ORDER, "fp16-rotary-torch"])
    runs, _ = results.load_experiment(str(tmp_path / "results"))
    assert list(runs) == ["grpo"] and list(runs["grpo"]) == ["fp16-rotary-torch"]
    cells = results.arm_cells(str(tmp_path / "results"), runs["grpo"], [], results.SUMMARY, False)
    results.print_table({"machine": "m", "arms": {"grpo": cells}}, results.SUMMARY)
    table = capsys.readouterr().out
    assert "| arm | fp16-rotary-torch |" in table and "0.5000 +- " in table, table


def test_a_run_folder_whose_name_does_not_parse_is_refused_by_name(tmp_path, capsys):
    """Not filed as an arm of its own: one line naming the folder, exit 2."""
    for name, args in (("gspo-engine-bf16-s0", {"dtype": "bf16", "seed": 0, "steps": 1}),
                       ("mystery-run", {"dtype": "bf16", "seed": 0, "steps": 1}),
                       ("gspo-engine-fp16-s0", {"dtype": "bf16", "seed": 0, "steps": 1})):
        folder = tmp_path / name
        folder.mkdir()
        (folder / "args.json").write_text(json.dumps(args))
        (folder / "metrics.jsonl").write_text("{}\n")
    shutil.rmtree(tmp_path / "gspo-engine-bf16-s0")  # the one that parses
    with pytest.raises(SystemExit) as e:
        results.load_experiment(str(tmp_path))
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and len(err.splitlines()) == 1
    assert "gspo-engine-fp16-s0" in err and "args.json" in err, err  # name and record disagree
    shutil.rmtree(tmp_path / "gspo-engine-fp16-s0")
    with pytest.raises(SystemExit):
        results.load_experiment(str(tmp_path))
    assert "mystery-run" in capsys.readouterr().err


def test_each_record_is_one_variant_and_names_parse_back():
    """Two records never write the same args.json; each name parses back to its record on
    each arm; the longest arm wins (grpo-len20 before grpo)."""
    signatures = [v.recorded() for v in variants.VARIANTS.values()]
    assert len(set(signatures)) == len(signatures)
    for arm in variants.ARMS:
        for v in variants.VARIANTS.values():
            assert variants.parse_run(f"{arm}-{v.name}-s3") == (arm, v, 3)
    with pytest.raises(ValueError):
        variants.add(variants.Variant("bf16-again", ("--dtype", "bf16")))
    assert variants.parse_run("grpo-bf16") is None and variants.parse_run("grpo-bf17-s0") is None
