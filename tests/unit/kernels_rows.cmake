# Row independence of every matmul kernel: a token's outputs are the same bits whether it is
# computed alone (the matvec) or in a batch of 2..17 (the tiles), for every weight type, every
# ISA of the machine, file and packed layouts. Batched greedy serving and speculative decoding's
# verification (a step of k + 1 rows of one sequence against k + 1 one-row steps) rely on it.
sh_test(test_kernels_rows SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_kernels_rows.c LABELS unit
        TIMEOUT 300)
