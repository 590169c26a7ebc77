# `shoal serve` end to end with real clients, each against its own `shoal serve --port 0`:
# the official openai client (needs scripts/test-venv.sh; skips without it unless
# SH_REQUIRE_OPENAI is set), curl, a corpus of bad requests under background load, and batching
# (greedy equivalence, KV exhaustion with preemption). Python runs through run_py.sh, which picks
# .cache/venv/bin/python3 when present. Exit 77 (no model) is a skip.
if(SH_FUZZ)
  return() # a fuzzing build builds only the fuzz targets' dependencies
endif()

# sh_serve_test(NAME COMMAND...): registers a script test of the integration label.
function(sh_serve_test name)
  add_test(NAME ${name} COMMAND ${ARGN} WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
  set_tests_properties(${name} PROPERTIES LABELS integration TIMEOUT 300 SKIP_RETURN_CODE 77
                       ENVIRONMENT "SH_SOURCE_DIR=${CMAKE_SOURCE_DIR};SH_BINARY_DIR=${CMAKE_BINARY_DIR};SH_SHOAL=$<TARGET_FILE:shoal>")
endfunction()

set(_d ${CMAKE_CURRENT_LIST_DIR})
sh_serve_test(test_serve_openai ${_d}/run_py.sh ${_d}/test_serve_openai.py)
sh_serve_test(test_serve_curl ${_d}/test_serve_curl.sh)
# What OpenAI and llama.cpp clients send beside the core endpoints: path aliases, CORS,
# system_fingerprint, cached_tokens, /tokenize and /detokenize, /v1/models, response_format.
sh_serve_test(test_serve_compat ${_d}/run_py.sh ${_d}/test_serve_compat.py)
# POST /v1/embeddings: the openai client, float/base64, alone vs batch of 32, a NumPy reference.
sh_serve_test(test_serve_embed ${_d}/run_py.sh ${_d}/test_serve_embed.py)
# Tool calls through the official openai client: auto, none, required, named (arguments validated
# with jsonschema; needs the grammar wired into sampling), streaming, a tool-message round trip.
sh_serve_test(test_serve_tools ${_d}/run_py.sh ${_d}/test_serve_tools.py)
# The Responses API (POST /v1/responses) through the official openai client: plain against chat,
# streaming events, forced tool calls validated with jsonschema, a function_call_output round
# trip, text.format json_schema, the refused fields.
sh_serve_test(test_serve_responses ${_d}/run_py.sh ${_d}/test_serve_responses.py)
# CORS from a real browser: a page on another origin in headless Chromium (skips without it).
sh_serve_test(test_serve_cors_browser ${_d}/run_py.sh ${_d}/test_serve_cors_browser.py)
# Structured output: JSON schemas validated with jsonschema, GBNF grammars checked by parsers of
# its own, streaming, n, bad grammars, a 2-stage pipeline (skips without jsonschema).
sh_serve_test(test_serve_grammar ${_d}/run_py.sh ${_d}/test_serve_grammar.py)
# Issue 28's validity acceptance: 30 JSON schemas and 10 GBNF grammars with parsers of its own,
# SH_GRAMMAR_ACCEPT_N requests each (2 here; the acceptance run sets 20).
sh_serve_test(test_serve_grammar_accept ${_d}/run_py.sh ${_d}/test_serve_grammar_accept.py)
set_tests_properties(test_serve_grammar_accept PROPERTIES TIMEOUT 600)
# A grammar whose matcher passes its bounds mid-generation fails its own request only (500, or an
# error event and [DONE] when streamed), in a batch with others, on one process and a pipeline.
sh_serve_test(test_serve_grammar_err ${_d}/run_py.sh ${_d}/test_serve_grammar_err.py)
sh_serve_test(test_serve_bad ${_d}/run_py.sh ${_d}/test_serve_bad.py)
sh_serve_test(test_serve_batch ${_d}/run_py.sh ${_d}/test_serve_batch.py)
# Sampling defaults (built-in, --temp and the like, the model file's general.sampling.*) and
# the sampling fields (typical_p, repetition penalties, the refused ones).
sh_serve_test(test_serve_sampling ${_d}/run_py.sh ${_d}/test_serve_sampling.py)
# About 100 s on an AVX-512 VM; 280-300 s on an AVX2-only one under the suite's -j2 load.
set_tests_properties(test_serve_batch PROPERTIES TIMEOUT 600)
# Speculative decoding (--spec ngram) against --spec off: exactness, metrics, opt-out, preemption.
sh_serve_test(test_serve_spec ${_d}/run_py.sh ${_d}/test_serve_spec.py)
set_tests_properties(test_serve_spec PROPERTIES TIMEOUT 600)
# A draft model (--spec draft:PATH, self:LAYERS) through the drafter actor against --spec off.
sh_serve_test(test_serve_draft ${_d}/run_py.sh ${_d}/test_serve_draft.py)
set_tests_properties(test_serve_draft PROPERTIES TIMEOUT 600)
sh_serve_test(test_serve_window ${_d}/run_py.sh ${_d}/test_serve_window.py)
sh_serve_test(test_serve_conns ${_d}/run_py.sh ${_d}/test_serve_conns.py)
sh_serve_test(test_serve_drain ${_d}/run_py.sh ${_d}/test_serve_drain.py)
sh_serve_test(test_serve_keys ${_d}/run_py.sh ${_d}/test_serve_keys.py)
sh_serve_test(test_serve_truncate ${_d}/run_py.sh ${_d}/test_serve_truncate.py)
sh_serve_test(test_serve_prompt ${_d}/run_py.sh ${_d}/test_serve_prompt.py)
sh_serve_test(test_serve_kvpressure ${_d}/run_py.sh ${_d}/test_serve_kvpressure.py)
sh_serve_test(test_cluster_pipeline ${_d}/run_py.sh ${_d}/test_cluster_pipeline.py)
# POST /v1/embeddings through a 2-stage pipeline of worker nodes: equal to one process; a worker
# killed mid-request and restarted (the request resumes).
sh_serve_test(test_cluster_embed ${_d}/run_py.sh ${_d}/test_cluster_embed.py)
# A replica's drafter on a worker node of its own against one process without speculation.
sh_serve_test(test_cluster_drafter ${_d}/run_py.sh ${_d}/test_cluster_drafter.py)
set_tests_properties(test_cluster_drafter PROPERTIES TIMEOUT 600)
# The same with a self-drafter (replica{ drafter = { self = LAYERS } }) before a 2-stage pipeline
# against the same cluster without a drafter, and the drafter fields' bad values.
sh_serve_test(test_cluster_drafter_self ${_d}/run_py.sh ${_d}/test_cluster_drafter_self.py)
set_tests_properties(test_cluster_drafter_self PROPERTIES TIMEOUT 600)
sh_serve_test(test_cluster_failure ${_d}/run_py.sh ${_d}/test_cluster_failure.py)
sh_serve_test(test_cluster_status ${_d}/run_py.sh ${_d}/test_cluster_status.py)
# The real Gemma 3 270M through serve (skips without models/gemma3-270m-q4_k_m.gguf).
sh_serve_test(test_serve_gemma3 ${_d}/run_py.sh ${_d}/test_serve_gemma3.py)
