#!/usr/bin/env bash
# The quickstart's SFT model trained 20 steps on reverse-text twice, side by side: the
# built-in environment, and a classic verifiers port of it (tests/fixtures/verifiers_envs/
# vf-reverse-text: the same system prompt, data and reward, verifiers 0.3.1 in its own venv).
# Prints each run's step-0 reward, its first and last 5 steps, and the mismatch KL at step 0.
#   bash scripts/verifiers_port_check.sh          (after scripts/quickstart.sh built outputs/reverse-text/sft)
set -euo pipefail
cd "$(dirname "$0")/.."
source scripts/env.sh
uv sync --quiet --compile-bytecode
[ -f outputs/reverse-text/sft/config.json ] || { echo "run scripts/quickstart.sh first (it builds outputs/reverse-text/sft)" >&2; exit 2; }
PY=$(cd tests && uv run --no-sync python -c "from verifiers_venvs import verifiers_venv; from test_verifiers_classic import CLASSIC; print(verifiers_venv('0.3.1', CLASSIC))")
OUT=outputs/verifiers-port-check
mkdir -p "$OUT"
sed "s#outputs/reverse-text/rl#$OUT/builtin#" configs/reverse-text/rl.toml > "$OUT/builtin.toml"
sed "s#outputs/reverse-text/rl#$OUT/classic#; s#^id = \"reverse-text\"#id = \"vf-reverse-text\"\npython = \"$PY\"#" configs/reverse-text/rl.toml > "$OUT/classic.toml"
for kind in builtin classic; do
    uv run --no-sync prime-rl "$OUT/$kind.toml" --clean --no-tmux --max-steps 20 > "$OUT/$kind.log" 2>&1
done
uv run --no-sync python - "$OUT" <<'PY'
import json, sys
for kind in ("builtin", "classic"):
    rows = [json.loads(line) for line in open(f"{sys.argv[1]}/{kind}/metrics.jsonl")]
    r = [x["reward/mean"] for x in rows if x.get("process") == "orchestrator" and "reward/mean" in x]
    kl = next(x["loss/mismatch_kl"] for x in rows if x.get("process") == "trainer" and "loss/mismatch_kl" in x)
    print(f"{kind:8s} step 0 {r[0]:.3f}  first 5 {sum(r[:5]) / 5:.3f}  last 5 {sum(r[-5:]) / 5:.3f}  mismatch KL step 0 {kl:.1e}")
PY
