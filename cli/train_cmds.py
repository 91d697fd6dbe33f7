"""Training commands: `train-models` (the bundled family) and `train-mtp` (an MTP / EAGLE-3 head)."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from specsched.cli.common import _print_json, app


@app.command("train-models")
def train_models(
    out: Path = typer.Option(Path("runtime/bundled"), help="output dir"),
    target_steps: Optional[int] = typer.Option(None, help="fixed target steps (default: --target-minutes)"),
    draft_steps: Optional[int] = typer.Option(None, help="fixed draft steps (default: --draft-minutes)"),
    mtp_steps: Optional[int] = typer.Option(None, help="fixed MTP-head steps (default: --mtp-minutes)"),
    target_minutes: float = typer.Option(60.0),
    draft_minutes: float = typer.Option(15.0),
    mtp_minutes: float = typer.Option(15.0),
    mtp_windows: int = typer.Option(16000, help="precomputed training windows for the MTP head"),
    mtp_onpolicy_frac: float = typer.Option(0.75, help="share of the head's windows continued by the target"),
    mtp_aux_layers: Optional[str] = typer.Option(None, help="earlier target layers the MTP head also reads "
                                                 "(comma-separated; '' for the last layer only; default 1,3, or with "
                                                 "--grow-from the grown target's layers that hold its head's)"),
    mtp_lr: float = typer.Option(2e-3, help="the MTP head's peak learning rate"),
    state: Optional[Path] = typer.Option(None, help="checkpoint dir: a rerun continues where the last stopped"),
    tokenizer: Optional[Path] = typer.Option(None, help="reuse this tokenizer.json instead of training one"),
    threads: int = typer.Option(2),
    batch_size: int = typer.Option(16, help="target/draft windows per step"),
    bf16: Optional[bool] = typer.Option(None, "--bf16/--no-bf16", help="bf16 autocast (default: where the "
                                        "CPU has native bf16)"),
    seed: int = typer.Option(0),
    target_shape: str = typer.Option("6x256", help="the target's LAYERSxHIDDEN; the draft has its width"),
    grow_from: Optional[Path] = typer.Option(None, help="a trained family (target/, draft/, mtp/) of the same width: "
                                             "its target deepened to --target-shape and trained on, its draft and "
                                             "MTP head continued against the result"),
    target_bf16: bool = typer.Option(False, "--target-bf16", help="store the target's weights as bf16"),
    draft_layers: int = typer.Option(1, min=1, help="the draft's depth (with --grow-from, a multiple of its "
                                     "draft's: that draft deepened to it)"),
) -> None:
    """Retrain the bundled family: tokenizer, target, draft, MTP head (needs the dev extra)."""
    from specsched.runtime.training.bundled import main as train_main
    from specsched.runtime.training.bundled import parse_shape
    from specsched.runtime.training.grow import grow_plan
    from specsched.runtime.training.mtp import train_mtp

    try:
        layers, _ = parse_shape(target_shape)
        grown = None if grow_from is None else grow_plan(grow_from, layers, draft_layers)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--target-shape / --draft-layers / --grow-from") from None
    aux = _layer_list(mtp_aux_layers, "--mtp-aux-layers") if mtp_aux_layers is not None else \
        grown.aux_layers if grown is not None else (1, 3)
    train_main(out_dir=str(out), target_minutes=target_minutes, draft_minutes=draft_minutes, seed=seed,
               target_steps=target_steps, draft_steps=draft_steps, num_threads=threads, state_dir=state,
               tokenizer=tokenizer, bf16=bf16, batch_size=batch_size, target_shape=target_shape,
               grow_from=grown and grown.target, target_bf16=target_bf16, draft_from=grown and grown.draft,
               draft_layers=draft_layers)
    train_mtp(out / "target", out / "mtp", mtp_steps, minutes=mtp_minutes, ablation=grown is None, seed=seed,
              num_windows=mtp_windows, num_threads=threads, bf16=bf16, onpolicy_frac=mtp_onpolicy_frac,
              aux_layers=aux, init_from=grown and grown.head, lr=mtp_lr)


def _layer_list(text: str, flag: str) -> tuple[int, ...]:
    """'1,3' -> (1, 3); a clear usage error otherwise."""
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise typer.BadParameter(f"not a comma-separated list of layer indices: {text!r}", param_hint=flag) from None


@app.command("train-mtp")
def train_mtp_cmd(
    target: Path = typer.Option(..., help="target checkpoint dir (HF layout)"),
    out: Path = typer.Option(..., help="output dir for the head"),
    steps: Optional[int] = typer.Option(None, help="fixed optimizer steps (default: a time budget)"),
    minutes: float = typer.Option(6.0, help="time budget when --steps is not given"),
    windows: int = typer.Option(2400, help="precomputed training windows (target hidden states)"),
    no_norms: bool = typer.Option(False, "--no-norms", help="EAGLE-style head without the restored RMSNorms"),
    ablation: bool = typer.Option(False, help="also train the other variant and record both in the card"),
    threads: int = typer.Option(1, help="torch threads (1 is fastest on a shared 2-core machine)"),
    bf16: Optional[bool] = typer.Option(None, "--bf16/--no-bf16", help="bf16 autocast (default: where the "
                                        "CPU has native bf16)"),
    onpolicy_frac: float = typer.Option(0.0, help="share of windows continued by the target's greedy tokens"),
    aux_layers: str = typer.Option("", help="comma-separated earlier target layers whose outputs the head also "
                                   "reads (EAGLE-3 features), e.g. 1,3"),
    init_from: Optional[Path] = typer.Option(None, help="a head directory to continue training from"),
    lr: float = typer.Option(2e-3, help="peak learning rate (warm-up, then cosine to a tenth of it)"),
    layout: str = typer.Option("specsched", help="specsched (this head's own network) | eagle3 (an EAGLE-3 "
                               "head in the layout vLLM and SGLang load; needs three --aux-layers)"),
    seed: int = typer.Option(0),
) -> None:
    """Train an MTP head on a target's hidden states (computed with specsched's own forward)."""
    from specsched.runtime.training.mtp import train_mtp

    layers = _layer_list(aux_layers, "--aux-layers")
    try:
        report = train_mtp(target, out, steps, minutes=minutes, norms=not no_norms, ablation=ablation,
                           seed=seed, num_windows=windows, num_threads=threads, bf16=bf16,
                           onpolicy_frac=onpolicy_frac, aux_layers=layers, init_from=init_from, lr=lr,
                           layout=layout)
    except ValueError as exc:  # a layer the target lacks, a head --init-from that does not fit
        raise typer.BadParameter(str(exc), param_hint="--aux-layers / --init-from / --layout") from None
    _print_json(report)
