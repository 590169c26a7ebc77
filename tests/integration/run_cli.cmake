# `shoal run` end to end: argument and file errors, golden ids and text through the real binary;
# --spec: every proposer's output equals --spec off's, bad values and drafts exit 2.
sh_test(test_run_cli SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_run_cli.c LABELS integration
        TIMEOUT 300)
# `shoal serve -c/-m` refusals (multi-node scripts, FIFO models) and script-relative model paths,
# through the real binary.
sh_test(test_serve_config SOURCES ${CMAKE_CURRENT_LIST_DIR}/test_serve_config.c LABELS integration
        TIMEOUT 240)
