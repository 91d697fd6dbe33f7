"""Model cards: a rerun of a card's command rewrites its figures and keeps the sections
written by hand (runtime/training/cards.py `save_card`)."""
from __future__ import annotations

from specsched.runtime.training import cards
from specsched.runtime.training.cards import save_card

GENERATED = ["# card", "", "intro", "", "## Acceptance", "", "AL 2.97", "", "## Reproduce", "", "    run it", ""]


def test_a_new_card_is_the_generated_text(tmp_path):
    path = tmp_path / "README.md"
    save_card(path, GENERATED)
    assert path.read_text() == "\n".join(GENERATED)


def test_hand_written_sections_stay_before_reproduce_and_generated_ones_are_replaced(tmp_path):
    path = tmp_path / "README.md"
    path.write_text("# card\n\nold intro\n\n## Acceptance\n\nAL 1.00\n\n## What the aux layers add\n\n"
                    "| head | AL |\n|---|---|\n| last layer | 2.83 |\n\n## Ablation\n\nwithout norms: 2.82\n\n"
                    "## Reproduce\n\n    old command\n")
    save_card(path, GENERATED)
    text = path.read_text()
    assert "AL 2.97" in text and "AL 1.00" not in text and "old intro" not in text and "old command" not in text
    assert text.index("## Acceptance") < text.index("## What the aux layers add") < text.index("## Ablation") \
        < text.index("## Reproduce")
    assert "| last layer | 2.83 |" in text and "without norms: 2.82" in text
    save_card(path, GENERATED)  # a second rerun changes nothing
    assert path.read_text() == text


def test_a_card_without_reproduce_section_gets_the_notes_at_the_end(tmp_path):
    path = tmp_path / "README.md"
    path.write_text("# card\n\n## Notes\n\nkept\n")
    save_card(path, ["# card", "", "figures", ""])
    assert path.read_text() == "# card\n\nfigures\n\n## Notes\n\nkept\n"


def _report() -> dict:
    losses = {"loss": 1.0, "kl": 0.5}
    return {"config": {"seed": 0, "batch_size": 8, "seq_len": 128, "lr": 0.002, "ce_weight": 0.1,
                       "hidden_weight": 0.1, "bf16": True},
            "variants": {"norms": {"train": {"steps": 10, "tokens_seen": 10240, "train_s": 60.0,
                                             "first_loss": losses, "final_loss": losses}}},
            "num_threads": 1, "target": "runtime/bundled/target", "target_fingerprint": "sha256:0",
            "precompute_s": 1.0, "aux_layers": [1, 3], "init_from": None,
            "corpus": {"train_files": 2, "heldout_files": 1, "train_windows": 16, "window_tokens": 130,
                       "onpolicy_windows": 0, "onpolicy_prompt": 64}}


def test_the_mtp_head_card_keeps_its_hand_written_section(tmp_path):
    path = tmp_path / "README.md"
    cards.write_head_card(path, _report(), shipped="norms")
    first = path.read_text()
    assert "--steps 10 --seed 0 --threads 1 --windows 16 --bf16 --aux-layers 1,3" in first
    path.write_text(first.replace("## Reproduce", "## What the aux layers add\n\nmeasured by hand\n\n## Reproduce"))
    report = _report()
    report["variants"]["norms"]["train"]["steps"] = 20
    cards.write_head_card(path, report, shipped="norms")
    text = path.read_text()
    assert "--steps 20" in text and "--steps 10" not in text
    assert text.index("measured by hand") < text.index("## Reproduce")
