#!/usr/bin/env bash
# Calls valora's OpenAI-compatible HTTP API with nothing but curl and base64.
#
# Usage: chat.sh BASE_URL MODEL "prompt" [image.png]
#   BASE_URL  the gateway's HTTP API, e.g. http://127.0.0.1:8080/v1
#   MODEL     adapters/NAME[@alias|/versions/N], tasks/NAME, or the base model's served name
#             (valora-base unless the gateway sets VALORA_SERVED_MODEL_NAME)
# Environment: VALORA_API_KEY (sent as "Authorization: Bearer"), MAX_TOKENS (default 16),
#              STREAM=1 (server-sent events: "data: {...}" chunks, then "data: [DONE]").
# Prints the response body; exits non-zero on an HTTP error (the OpenAI-style error JSON is printed).
set -euo pipefail

base_url=${1:?usage: chat.sh BASE_URL MODEL \"prompt\" [image.png]}
model=${2:?model missing}
prompt=${3:?prompt missing}
image=${4:-}

json_escape() {
  local s=${1//\\/\\\\}
  s=${s//\"/\\\"}
  s=${s//$'\n'/\\n}
  s=${s//$'\r'/\\r}
  s=${s//$'\t'/\\t}
  printf '%s' "$s"
}

stream=false
[ "${STREAM:-0}" = "1" ] && stream=true
content="{\"type\":\"text\",\"text\":\"$(json_escape "$prompt")\"}"

headers=(-H "Content-Type: application/json")
[ -n "${VALORA_API_KEY:-}" ] && headers+=(-H "Authorization: Bearer ${VALORA_API_KEY}")

# The body goes through stdin: a base64 image can be larger than a command line allows.
{
  printf '{"model":"%s","stream":%s,"max_tokens":%d,"messages":[{"role":"user","content":[%s' \
    "$(json_escape "$model")" "$stream" "${MAX_TOKENS:-16}" "$content"
  if [ -n "$image" ]; then
    case "$image" in
      *.jpg|*.jpeg) mime=image/jpeg ;;
      *.webp) mime=image/webp ;;
      *) mime=image/png ;;
    esac
    printf ',{"type":"image_url","image_url":{"url":"data:%s;base64,' "$mime"
    base64 -w0 "$image"
    printf '"}}'
  fi
  printf ']}]}'
} | curl --silent --show-error --no-buffer --fail-with-body "${headers[@]}" \
    --data-binary @- "${base_url%/}/chat/completions"
echo
