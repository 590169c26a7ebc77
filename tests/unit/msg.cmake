# The wire codec: envelope, msgpack reader/writer, and every message body.
sh_test(test_msg SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_msg.c
        ${CMAKE_CURRENT_LIST_DIR}/test_msg_samples.c LABELS unit TIMEOUT 60)
sh_test(test_msg_proto SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_msg_proto.c
        ${CMAKE_CURRENT_LIST_DIR}/test_msg_samples.c LABELS unit TIMEOUT 60)
# The seal between nodes: CRC-32C values and paths, every byte position, a runtime's drop count.
sh_test(test_msg_seal SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_msg_seal.c
        ${CMAKE_CURRENT_LIST_DIR}/test_msg_samples.c LABELS unit TIMEOUT 60)
