"""
experiments/campaign_figure.py: RL over seeds, paired. The campaign's runs of one machine
(results/<machine>/, campaign.py) as one row of panels per arm, and the sanity tables.

    AMD=results/amd-epyc-avx2-avx512f-avx512-bf16
    XEON=results/intel-xeon-processor-2-80ghz-avx2-avx512f
    AMX=results/intel-xeon-processor-avx2-avx512f-avx512-bf16-avx512-fp16-amx-tile-amx-bf16
    python experiments/campaign_figure.py $AMD --out figures/campaign-amd.png
    python experiments/campaign_figure.py $XEON --out figures/campaign.png
    python experiments/campaign_figure.py $AMX --arms gspo-engine --out figures/campaign-amx.png

Per arm and variant: the training reward, the held-out accuracy, the per-token mismatch and
the clipped shares by the sign of A, over the steps (mean over seeds, its s.e. shaded); then
the tables of results.print_table. The dial's dosed runs are not campaign runs: left out
(dial_figure.py draws them). The numbers drawn go to a JSON beside the PNG: fixes.py and
readme_figure.py read it. Page: experiments/campaign.md.
"""
from results import SUMMARY, draw, parse_runs, print_table, runs_parser, save

PANELS = [("reward_mean", "training reward"),
          ("eval_accuracy", "held-out accuracy"),
          ("mismatch_logp_abs_mean", "mean |log mu - log pi|"),
          ("clip_frac_neg", "clipped tokens, A < 0"),
          ("clip_frac_pos", "clipped tokens, A > 0")]

def main(argv=None):
    args = parse_runs(runs_parser("RL over seeds, paired: a machine's campaign"), argv)
    fig, table = draw(args.path, args.seeds, args.arms, PANELS, SUMMARY, with_warm=False)
    print_table(table, SUMMARY)
    save(fig, args.out, table)

if __name__ == "__main__":
    main()
