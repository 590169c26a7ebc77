# Transport and fault injection: in-process clusters, back-pressure, bombardment, TLS, the stream
# engine, faults.
sh_test(test_transport SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_transport.c LABELS unit TIMEOUT 120)
sh_test(test_transport_bombard SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_transport_bombard.c
        LABELS unit TIMEOUT 120)
sh_test(test_transport_tls SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_transport_tls.c
        LABELS unit TIMEOUT 120)
sh_test(test_fault SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_fault.c LABELS unit TIMEOUT 120)
sh_test(test_transport_stream SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_transport_stream.c LABELS unit
        TIMEOUT 120)
sh_test(test_fault_transport SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_fault_transport.c LABELS unit
        TIMEOUT 120)
sh_test(test_transport_preauth SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_transport_preauth.c
        LABELS unit TIMEOUT 120)
