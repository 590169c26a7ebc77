# The embedding API (include/shoal.h, api/): an engine on the tiny stories260K model, driven as a
# host program would drive it. Greedy output against `shoal run`'s, concurrency, cancel, every
# misuse of issue 14's acceptance, the memory budget, nothing written to stdout/stderr, and 100
# open/submit/close cycles (leak-checked in the ASan suite).
sh_test(test_engine SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_engine.c LABELS unit TIMEOUT 300)
# The engine fronting real `shoal node` workers, one killed mid-generation: its supervisor
# promotes a standby or waits for the restarted node (every output equals the undisturbed run's),
# or fails stop after its 30 s wait (about 35 s in all).
sh_test(test_engine_failover SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_engine_failover.c LABELS integration TIMEOUT 300)
# Embeddings through the C API (sh_request_opts.embed): unit vectors in on_done, the same alone
# and among 15 other requests, text and token-id prompts.
sh_test(test_engine_embed SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_engine_embed.c LABELS unit TIMEOUT 120)
# Tool calls through the C API (sh_request_opts.messages_json, tools, tool_choice) on the default
# model: forced and named calls following their schemas, a round trip with a tool message, the
# chat as JSON equal to the chat as structs, and each bad field refused naming it.
sh_test(test_engine_tools SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_engine_tools.c LABELS unit TIMEOUT 300)
# The engine fronting a replica whose drafter runs on a `shoal node` of its own (a draft file, the
# model itself; self = 3): greedy outputs, one by one and all at once, equal the same cluster's
# without a drafter.
sh_test(test_engine_drafter SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_engine_drafter.c LABELS integration TIMEOUT 300)
