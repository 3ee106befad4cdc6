#!/usr/bin/env bash
# Build the isolated Qwen3-TTS reference environment .ttsref and the oracle outputs the tests
# under tests/speech_oracle compare against:
#   .ttsref/             a virtualenv with the reference implementation (qwen-tts 0.1.1), which
#                        pins transformers 4.57.3 and so cannot share the project venv
#   .ttsref/tiny-tts/    a tiny random-weight CustomVoice checkpoint built with the reference's
#                        own classes (seed 0: the same bytes on every machine)
#   .ttsref/tiny-ref/    reference_outputs.{npz,json}: the reference run greedy on it
# The two builder scripts are not part of this repository: they live in shared/speech beside
# the clone (OMNI_TTS_SCRIPTS overrides the folder). Nothing here is downloaded at run time
# but packages; the checkpoint is made locally.
# Run the oracle tests with:
#   OMNI_TTS_ORACLE=$PWD/.ttsref .venv/bin/python -m pytest -q -p no:cacheprovider tests/speech_oracle
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
SCRIPTS=${OMNI_TTS_SCRIPTS:-"$(dirname "$ROOT")/shared/speech"}
for f in make_tiny_qwen3_tts.py reference_outputs.py smol_tokenizer.json; do
  if [ ! -f "$SCRIPTS/$f" ]; then
    echo "install_ttsref: $SCRIPTS/$f is missing: the reference builder scripts are expected in" \
         "shared/speech beside the repository (or set OMNI_TTS_SCRIPTS to their folder)" >&2
    exit 1
  fi
done
REF=.ttsref
PY=${PYTHON:-python3}
PACKAGES=("torch==2.13.0" "transformers==4.57.3" "accelerate==1.12.0" librosa einops soundfile numpy)
REFERENCE="qwen-tts==0.1.1"

# One stamp for what the outputs were made from: the pins and the builder scripts. A rerun
# with the same stamp and complete outputs does nothing.
STAMP=$( { printf '%s\n' "${PACKAGES[@]}" "$REFERENCE"; cat "$SCRIPTS/make_tiny_qwen3_tts.py" \
  "$SCRIPTS/reference_outputs.py" "$SCRIPTS/smol_tokenizer.json"; } | sha256sum | cut -d' ' -f1)
if [ -f "$REF/stamp" ] && [ "$(cat "$REF/stamp")" = "$STAMP" ] \
   && [ -f "$REF/tiny-ref/reference_outputs.npz" ] && [ -f "$REF/tiny-ref/reference_outputs.json" ]; then
  echo "install_ttsref: $ROOT/$REF is up to date"
  exit 0
fi

start=$SECONDS
if [ ! -x "$REF/bin/python" ]; then
  "$PY" -m venv "$REF"
fi
"$REF/bin/python" -m pip install -q "${PACKAGES[@]}"
# --no-deps: its gradio, torchaudio, sox and onnxruntime requirements serve the 25 Hz tokenizer
# and the demo UI, never the 12 Hz path; the builder scripts stub the imports that are absent.
"$REF/bin/python" -m pip install -q --no-deps "$REFERENCE"
echo "install_ttsref: packages in $((SECONDS - start)) s"

# Each builder's output goes to its log (the reference prints a warning per generate call);
# a failure shows the log's end.
run_logged() {
  local log=$1
  shift
  if ! "$@" > "$log" 2>&1; then
    echo "install_ttsref: failed: $*" >&2
    tail -n 40 "$log" >&2
    exit 1
  fi
}
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
rm -rf "$REF/tiny-tts" "$REF/tiny-ref" "$REF/stamp"
run_logged "$REF/make_tiny.log" "$REF/bin/python" "$SCRIPTS/make_tiny_qwen3_tts.py" "$REF/tiny-tts" --seed 0
run_logged "$REF/reference.log" "$REF/bin/python" "$SCRIPTS/reference_outputs.py" "$REF/tiny-tts" --out "$REF/tiny-ref"
echo "$STAMP" > "$REF/stamp"
echo "install_ttsref: reference environment and oracle outputs in $ROOT/$REF ($((SECONDS - start)) s)"
