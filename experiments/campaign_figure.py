"""
experiments/campaign_figure.py: RL over seeds, paired. The campaign's runs of one machine
(results/<machine>/, campaign.py) as one row of panels per arm, and the sanity tables.

    AMD=results/amd-epyc-avx2-avx512f-avx512-bf16
    XEON=results/intel-xeon-processor-2-80ghz-avx2-avx512f
    AMX=results/intel-xeon-processor-avx2-avx512f-avx512-bf16-avx512-fp16-amx-tile-amx-bf16
    python experiments/campaign_figure.py $AMD --out figures/campaign-amd.png
    python experiments/campaign_figure.py $XEON --out figures/campaign.png
    python experiments/campaign_figure.py $AMX --arms gspo-engine --seeds 0 1 2 3 4 5 6 7 \
        --variants fp16 bf16 fp32 bf16-head32 bf16-engine32 bf16-aligned \
        --out figures/campaign-amx.png

Per arm and variant: the training reward, the held-out accuracy, the per-token mismatch and
the clipped shares by the sign of A, over the steps (mean over seeds, its s.e. shaded); then
the tables of results.print_table. The dial's dosed runs are not campaign runs: left out
(dial_figure.py draws them). The numbers drawn go to a JSON beside the PNG: fixes.py and
readme_figure.py read it. Page: experiments/campaign.md.
"""
from results import (SUMMARY, draw, parse_runs, print_table, runs_parser, save,
                     with_variants)

PANELS = [("reward_mean", "training reward"),
          ("eval_accuracy", "held-out accuracy"),
          ("mismatch_logp_abs_mean", "mean |log mu - log pi|"),
          ("clip_frac_neg", "clipped tokens, A < 0"),
          ("clip_frac_pos", "clipped tokens, A > 0")]

def main(argv=None):
    p = with_variants(runs_parser("RL over seeds, paired: a machine's campaign"))
    args = parse_runs(p, argv)
    fig, table = draw(args.path, args.seeds, args.arms, PANELS, SUMMARY, with_warm=False,
                      variants=args.variants)
    print_table(table, SUMMARY)
    save(fig, args.out, table)

if __name__ == "__main__":
    main()
