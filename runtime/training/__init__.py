"""Offline training of the bundled tiny model family (tokenizer, target, draft).

Needs the `dev` extra (transformers) at training time only; the runtime never imports this.
"""
