# Helpers that keep each directory's build description short.

# sh_add_sources(TARGET DIR...): adds every .c file directly under each DIR to TARGET.
function(sh_add_sources target)
  foreach(dir IN LISTS ARGN)
    file(GLOB srcs CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/${dir}/*.c)
    target_sources(${target} PRIVATE ${srcs})
  endforeach()
endfunction()

# sh_test(NAME SOURCES f.c... [LABELS l...] [TIMEOUT s] [ARGS a...] [LIBS lib...]
#         [WORKING_DIRECTORY dir])
# Builds one test executable linked with the core library and registers it with ctest under its
# labels and a timeout (default 60 s). Exit code 77 means skipped.
function(sh_test name)
  if(SH_FUZZ)
    return() # a fuzzing build builds only the fuzz targets' dependencies
  endif()
  cmake_parse_arguments(T "" "TIMEOUT;WORKING_DIRECTORY" "SOURCES;LABELS;ARGS;LIBS" ${ARGN})
  if(NOT T_TIMEOUT)
    set(T_TIMEOUT 60)
  endif()
  if(NOT T_LABELS)
    set(T_LABELS unit)
  endif()
  if(NOT T_WORKING_DIRECTORY)
    set(T_WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
  endif()
  add_executable(${name} ${T_SOURCES})
  target_compile_options(${name} PRIVATE ${SH_WARN_FLAGS})
  target_include_directories(${name} PRIVATE ${CMAKE_SOURCE_DIR}/tests)
  target_link_libraries(${name} PRIVATE shoal_core ${T_LIBS})
  add_test(NAME ${name} COMMAND ${name} ${T_ARGS} WORKING_DIRECTORY ${T_WORKING_DIRECTORY})
  set_tests_properties(${name} PROPERTIES LABELS "${T_LABELS}" TIMEOUT ${T_TIMEOUT}
                       SKIP_RETURN_CODE 77
                       ENVIRONMENT "SH_SOURCE_DIR=${CMAKE_SOURCE_DIR};SH_BINARY_DIR=${CMAKE_BINARY_DIR};SH_SHOAL=$<TARGET_FILE:shoal>")
endfunction()

# sh_fuzz(NAME SOURCES f.c... [SECONDS s] [CORPUS dir]): a libFuzzer target (SH_FUZZ builds only),
# registered as a ctest test with label `fuzz` that runs for a bounded time: SH_FUZZ_SECONDS when
# it is set (it overrides every target), else the target's own SECONDS, else 30.
function(sh_fuzz name)
  if(NOT SH_FUZZ)
    return()
  endif()
  cmake_parse_arguments(F "" "SECONDS;CORPUS" "SOURCES" ${ARGN})
  if(NOT "${SH_FUZZ_SECONDS}" STREQUAL "")
    set(F_SECONDS ${SH_FUZZ_SECONDS})
  elseif(NOT F_SECONDS)
    set(F_SECONDS 30)
  endif()
  add_executable(${name} ${F_SOURCES})
  target_compile_options(${name} PRIVATE ${SH_WARN_FLAGS})
  target_include_directories(${name} PRIVATE ${CMAKE_SOURCE_DIR}/tests)
  target_link_libraries(${name} PRIVATE shoal_core)
  target_link_options(${name} PRIVATE -fsanitize=fuzzer)
  set(workdir ${CMAKE_BINARY_DIR}/fuzz-corpus/${name})
  file(MAKE_DIRECTORY ${workdir})
  set(cmd ${name} -max_total_time=${F_SECONDS} -rss_limit_mb=2048 -timeout=10 ${workdir})
  if(F_CORPUS)
    list(APPEND cmd ${F_CORPUS})
  endif()
  add_test(NAME ${name} COMMAND ${cmd} WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
  math(EXPR limit "${F_SECONDS} * 2 + 60")
  set_tests_properties(${name} PROPERTIES LABELS fuzz TIMEOUT ${limit})
endfunction()

# sh_bench(NAME SOURCES f.c...): a benchmark program linked with the core library, built into
# build/bench/. Benchmarks print figures; they are not tests. Skipped in fuzzing builds.
function(sh_bench name)
  if(SH_FUZZ)
    return()
  endif()
  cmake_parse_arguments(B "" "" "SOURCES" ${ARGN})
  add_executable(${name} ${B_SOURCES})
  target_compile_options(${name} PRIVATE ${SH_WARN_FLAGS})
  target_link_libraries(${name} PRIVATE shoal_core)
  set_target_properties(${name} PROPERTIES RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bench)
endfunction()
