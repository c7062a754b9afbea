#!/usr/bin/env bash
# Rebuild, from the shipped dialog model, the lineage of the query-writing tiny models that did not ship
# (docs/training.md, sessions 48-53): query stages -> Level-2 fine-tune -> Level-1 corpus with query drills ->
# asking return visits -> same-person greetings. Every stage is the command its session documented; a stage
# whose lm.safetensors exists is skipped, one with a checkpoint resumes, so a killed rebuild goes on where it
# stopped (run it again). About 4 h on one core (session 54: the three query stages 90 min, their clip banks
# 40 min on the other core).
#
#   bash bench/rebuild_query_lineage.sh [RUNS_DIR] [THREADS]     # default: runs/, 1 thread
#
# On one thread a stage that ran on one thread in its session is rebuilt to the digit (session 48's two); the
# ones that ran on two drift a little. What each stage is and reached: docs/training.md, "Rebuilding the lineage".
set -euo pipefail
cd "$(dirname "$0")/.."
R=${1:-runs}
T=${2:-1}
EGOMEM=${EGOMEM:-.venv/bin/egomem}
export OMP_NUM_THREADS=$T
SHIPPED=egomem/data/dialog_tiny.safetensors

log() { echo "[$(date +%H:%M:%S)] $*"; }

# stage OUT_RUN_DIR COMMAND...: skip when OUT/lm.safetensors exists, resume when OUT/ckpt does
stage() {
  local out=$1; shift
  if [ -f "$out/lm.safetensors" ]; then log "have $out/lm.safetensors"; return; fi
  local resume=()
  [ -f "$out/ckpt/state.pt" ] && resume=(--resume)
  log "stage $out ${resume[*]}"
  "$EGOMEM" "$@" --out "$out" --threads "$T" --no-progress "${resume[@]}"
}

# corpus OUT ARGS...: make-corpus unless OUT/manifest.json exists (make-corpus writes it last)
corpus() {
  local out=$1; shift
  if [ -f "$out/manifest.json" ]; then log "have $out"; return; fi
  log "corpus $out"
  rm -rf "$out"
  "$EGOMEM" make-corpus --out "$out" "$@" --generator template --listen whole --threads "$T"
}

QUERY_STAGE=(train-backbone --task query --batch-size 16 --lr 1e-3 --warmup 30 --seed 3 --eval-every 100
             --ckpt-every 100 --head-weight 4)
# session 48: the 23 core relations in 96 voices, then 80 relations in 48
stage "$R/s48/qcore/run" "${QUERY_STAGE[@]}" --weights "$SHIPPED" --relations 23 --voices 96 --steps 800
stage "$R/s48/qmix/run" "${QUERY_STAGE[@]}" --weights "$R/s48/qcore/run/lm.safetensors" --relations 80 \
  --voices 48 --steps 400
# session 49: 16 of each relation's 18 sentences, each in 6 of the 48 voices
stage "$R/s49/qsent/run" "${QUERY_STAGE[@]}" --weights "$R/s48/qmix/run/lm.safetensors" --relations 80 \
  --voices 48 --templates 16 --voices-per-question 6 --steps 400

corpus "$R/s46/l2/heldout" --households 16 --split heldout --seed 1 --levels 1,2      # the card's held-out set
corpus "$R/s49/heldout_trainrel" --households 16 --split heldout --seed 1 --levels 1,2 --relation-words train
corpus "$R/s46/l2/train" --households 400 --split train --seed 0 --levels 1,2 --own-questions 1,2 --return-visit 1.0
corpus "$R/s46/l1/train" --households 400 --split train --seed 2 --levels 1 --own-questions 1,2 --return-visit 1.0
corpus "$R/s52/visit/train" --households 400 --split train --seed 6 --levels 1,2 --own-questions 1,2 \
  --return-visit 1.0 --graph-dialogs 0 --visit-asks 0.5

DIALOG=(finetune --batch-size 4 --dialog-steps 192 --eval-data "$R/s46/l2/heldout" --fresh-names 1 --drills 0.2
        --drill-random-l1 0.5 --drill-span 100 180 --context dialog
        --query-relations 80 --query-voices 48 --query-templates 16 --query-voices-per-question 6
        --query-bank "$R/s49/qsent/run/query_clips_train.npz")
# the listening drills' clip bank is seeded (--listen-seed, default --seed): one file per seed, each built
# (~10 min) by the first stage that needs it (the sessions shared one path, rebuilt when the seed changed)
mkdir -p "$R/banks"
listen_bank() { echo --listen-bank "$R/banks/listen_clips_train_seed$1.npz"; }
# session 49 (l2s): the Level-2 corpus with query drills from the all-sentence stage
stage "$R/s49/l2s/run" "${DIALOG[@]}" --data "$R/s46/l2/train" --weights "$R/s49/qsent/run/lm.safetensors" \
  --steps 800 --lr 5e-4 --seed 3 --eval-every 400 --listen-drills 0.2 --query-drills 0.3 $(listen_bank 3)
# session 51 (l1q40): back on the Level-1 corpus, query drills 0.4
stage "$R/s51/l1q40/run" "${DIALOG[@]}" --data "$R/s46/l1/train" --weights "$R/s49/l2s/run/lm.safetensors" \
  --steps 600 --lr 3e-4 --seed 4 --query-seed 3 --listen-seed 4 --eval-every 300 --listen-drills 0.25 \
  --query-drills 0.4 $(listen_bank 4)
# session 52 (vq): return visits that ask about a relation
stage "$R/s52/vq/run" "${DIALOG[@]}" --data "$R/s52/visit/train" --weights "$R/s51/l1q40/run/lm.safetensors" \
  --steps 600 --lr 3e-4 --seed 6 --query-seed 3 --listen-seed 4 --eval-every 300 --listen-drills 0.25 \
  --query-drills 0.4 $(listen_bank 4)
# session 53 (vs8): the same from l1q40 with the same-person greetings drawn 8 times an epoch
stage "$R/s53/vs8/run" "${DIALOG[@]}" --data "$R/s52/visit/train" --weights "$R/s51/l1q40/run/lm.safetensors" \
  --steps 600 --lr 3e-4 --seed 6 --query-seed 3 --listen-seed 4 --eval-every 300 --listen-drills 0.25 \
  --query-drills 0.4 --same-person-repeat 8 $(listen_bank 4)
log "lineage complete under $R/"
