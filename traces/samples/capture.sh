#!/usr/bin/env bash
# Recreates the sample traces and their timeline pictures from the bundled models.
# Run from the repository root inside the venv (or through ./dev): bash traces/samples/capture.sh
set -euo pipefail
out=traces/samples
common=(--num-requests 6 --max-tokens 48 --concurrency 2 --warmup 0)
specsched bench --spec draft --draft-len 4 --schedule sync    "${common[@]}" --trace $out/draft_sync.jsonl
specsched bench --spec draft --draft-len 4 --schedule overlap "${common[@]}" --trace $out/draft_overlap.jsonl
specsched bench --spec mtp   --draft-len 1 --schedule mtp     "${common[@]}" --trace $out/mtp_mtp.jsonl
for name in draft_sync draft_overlap mtp_mtp; do
    specsched timeline $out/$name.jsonl -o $out/$name.png --steps 20:26
done
