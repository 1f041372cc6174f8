#!/bin/sh
# The words task as a shell agent: one chat call with curl (jq builds the JSON from the row on
# stdin); it prints no reward, so the env's reward functions score the completion.
set -eu
auth="Authorization: Bearer $OPENAI_API_KEY"
model=$(curl -sf -H "$auth" "$OPENAI_BASE_URL/models" | jq -r '.data[0].id')
jq -c --arg model "$model" '{model: $model, messages: .prompt, max_tokens: 16}' |
  curl -sf -H "$auth" -H "Content-Type: application/json" -d @- "$OPENAI_BASE_URL/chat/completions" >/dev/null
echo null
