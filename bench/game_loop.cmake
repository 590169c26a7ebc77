# bench_game_loop: examples/game-loop/game_loop.c built in the tree (issue 14's tick-overrun
# figures; bench/README.md, "Game loop").
sh_bench(bench_game_loop SOURCES ${CMAKE_SOURCE_DIR}/examples/game-loop/game_loop.c)
