# Wire codec fuzzers: whole frames, and the body decoder's dispatch over every message type.
# Seed corpora: valid frames written by test_msg_proto (SH_MSG_WRITE_CORPUS=tests/fuzz/corpus/msg).
sh_fuzz(fuzz_msg_env SOURCES ${CMAKE_CURRENT_LIST_DIR}/fuzz_msg_env.c SECONDS 20
        CORPUS ${CMAKE_CURRENT_LIST_DIR}/corpus/msg/env)
sh_fuzz(fuzz_msg_body SOURCES ${CMAKE_CURRENT_LIST_DIR}/fuzz_msg_body.c SECONDS 20
        CORPUS ${CMAKE_CURRENT_LIST_DIR}/corpus/msg/body)
# The ipc:// engine's stream parser on a real connection (seeds: a handshake and valid frames).
sh_fuzz(fuzz_ipc_stream SOURCES ${CMAKE_CURRENT_LIST_DIR}/fuzz_ipc_stream.c SECONDS 20
        CORPUS ${CMAKE_CURRENT_LIST_DIR}/corpus/ipc)
