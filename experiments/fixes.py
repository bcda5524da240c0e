"""
experiments/fixes.py: the fixes side by side, offline and in RL, one table.

    P=figures/probe; C=figures/campaign; F=figures/fixes
    python experiments/fixes.py $P-amd.json $C-amd.json --out $F-amd.json  # the AMD EPYC
    python experiments/fixes.py $P.json $C.json --out $F.json              # the Intel Xeon

For each fix: the mismatch it leaves on identical tokens (the probe's paired rows,
mismatch.py) against bf16's with its 95 % bootstrap interval, the RL result in each arm paired
against bf16 (campaign_figure.py's JSON), what it costs (engine sampling, trainer forward +
backward), and what adopting it changes in the code. A table only: the JSON is the figure.
Both files must come from one machine. Page: experiments/fixes.md.
"""
import common
from common import load_json, machine_line, refuse, write_json

FIXES = [  # variant, the probe's matched (engine, trainer) row, what adopting it changes
    ("bf16", ("bf16", "bf16"), "the baseline"),
    ("fp16", ("fp16", "fp16"),
     "a flag, --dtype fp16 (the GradScaler, a pass-through elsewhere, turns on)"),
    ("bf16-head32", ("bf16+head32", "bf16+head32"),
     "6 lines: model.forward's head_dtype, Precision, hf_overrides, the flag"),
    ("bf16-engine32", ("fp32", "bf16"),
     "3 lines: get_precision's engine dtype, the sync's cast to it, the flag"),
    ("fp32", ("fp32", "fp32"), "a flag, --dtype fp32: no 16-bit rounding on either side"),
    ("bf16-aligned", ("bf16", "bf16-aligned"),
     "aligned.py: the trainer calls vLLM's CPU ops, backward by hand; CPU only"),
]

def fixes(probe_path, experiment_path, out):
    result, exp = load_json(probe_path, "mismatch"), load_json(experiment_path, "experiment")
    if machine_line(result["machine"]) != exp["machine"]:  # two chips: not one fix's
        refuse(f"{probe_path} and {experiment_path} come from different machines")
    rows = {(r["engine"], r["trainer"]): r for r in result["paired_rows"]}
    speed, cost = result["engine_tokens_per_s"], result["trainer_fwd_bwd_s"]
    arms = [a for a in exp["arms"]
            if any(c.get("reward_last10_minus_bf16") for c in exp["arms"][a].values())]
    print(f"{'fix':14} {'|log mu - log pi|':>17} {'vs bf16 [95% CI]':>24} "
          + " ".join(f"{a + ': reward vs bf16 [95% CI]':>40}" for a in arms)
          + f" {'engine tok/s':>13} {'trainer':>8}  adopt")
    table = []
    for v, (engine, trainer), how in FIXES:
        r = rows[engine, trainer]
        rl = {a: exp["arms"][a].get(v, {}).get("reward_last10_minus_bf16") for a in arms}
        table.append({"fix": v, "mismatch_logp_abs_mean": r["mismatch_logp_abs_mean"],
                      "over_bf16": r["over_bf16"], "adopt": how,
                      "engine_speed_vs_bf16": speed[engine] / speed["bf16"],
                      "trainer_time_vs_bf16": cost[trainer] / cost["bf16"], "rl": rl})
        print_fix(table[-1])
    write_json(out, {"fixes": table, "machine": result["machine"]})
    print(f"written {out}")

def print_fix(entry):
    o = entry["over_bf16"]
    def cell(d):
        return f"{d['mean']:+.4f} [{d['ci95'][0]:+.4f}, {d['ci95'][1]:+.4f}] n={d['n']}"

    cells = [cell(d) if d else "-" for d in entry["rl"].values()]
    print(f"{entry['fix']:14} {entry['mismatch_logp_abs_mean']:>17.2e} {o['ratio']:>8.3f} "
          f"[{o['ci95'][0]:.3f}, {o['ci95'][1]:.3f}] " + " ".join(f"{c:>40}" for c in cells)
          + f" {entry['engine_speed_vs_bf16']:>12.2f}x {entry['trainer_time_vs_bf16']:>7.2f}x  "
          f"{entry['adopt']}")

def main(argv=None):
    p = common.parser("the fixes side by side (the docstring)")
    p.add_argument("probe", help="the JSON of mismatch.py (every fix, with costs)")
    p.add_argument("experiment", help="the JSON campaign_figure.py wrote, same machine")
    p.add_argument("--out", required=True, help="the JSON to write (a table only)")
    args = p.parse_args(argv)
    fixes(args.probe, args.experiment, args.out)

if __name__ == "__main__":
    main()
