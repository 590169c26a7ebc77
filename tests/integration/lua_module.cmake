# test_lua_module: the Lua module of api/lua/ (the target shoal_lua) as a host's Lua sees it. The
# system lua5.4 runs test_shoal_lua.lua with the built module against the real stories260K model.
# In a sanitizer build the module needs the sanitizer runtimes loaded before lua5.4 (which is not
# instrumented): they are preloaded. Skipped (77) without the interpreter (scripts/bootstrap.sh
# installs it).
if(NOT TARGET shoal_lua)
  return()
endif()
find_program(SH_LUA_INTERP lua5.4)
set(_sh_lua_args ${CMAKE_SOURCE_DIR}/api/lua/test_shoal_lua.lua
    ${CMAKE_SOURCE_DIR}/tests/data/stories260K/stories260K.gguf
    ${CMAKE_SOURCE_DIR}/tests/data/stories260K/expected_ids_bos_256.txt)
if(SH_LUA_INTERP)
  set(_sh_lua_env "LUA_CPATH=$<TARGET_FILE_DIR:shoal_lua>/?.so" "LUA_PATH=")
  set(_sh_lua_preload "")
  if(CMAKE_C_COMPILER_ID MATCHES "Clang" AND (SH_ASAN OR SH_FUZZ))
    # clang links its sanitizer runtime into executables only: the module's host needs the
    # shared one, which carries UBSan's and the coverage callbacks (SH_FUZZ) too.
    execute_process(COMMAND ${CMAKE_C_COMPILER} --print-runtime-dir
                    OUTPUT_VARIABLE _sh_rt_dir OUTPUT_STRIP_TRAILING_WHITESPACE)
    list(APPEND _sh_lua_preload
         ${_sh_rt_dir}/libclang_rt.asan-${CMAKE_SYSTEM_PROCESSOR}.so)
  else()
    foreach(_rt asan ubsan tsan)
      if((_rt STREQUAL "asan" AND SH_ASAN) OR (_rt STREQUAL "ubsan" AND SH_UBSAN)
         OR (_rt STREQUAL "tsan" AND SH_TSAN))
        execute_process(COMMAND ${CMAKE_C_COMPILER} -print-file-name=lib${_rt}.so
                        OUTPUT_VARIABLE _sh_rt_path OUTPUT_STRIP_TRAILING_WHITESPACE)
        list(APPEND _sh_lua_preload ${_sh_rt_path})
      endif()
    endforeach()
  endif()
  if(_sh_lua_preload)
    list(JOIN _sh_lua_preload " " _sh_lua_preload)
    list(APPEND _sh_lua_env "LD_PRELOAD=${_sh_lua_preload}")
  endif()
  add_test(NAME test_lua_module COMMAND ${SH_LUA_INTERP} ${_sh_lua_args}
           WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
  set_tests_properties(test_lua_module PROPERTIES ENVIRONMENT "${_sh_lua_env}"
                       REQUIRED_FILES $<TARGET_FILE:shoal_lua>)
  # Tool calls from Lua on the default model (skipped, 77, without it).
  add_test(NAME test_lua_module_tools
           COMMAND ${SH_LUA_INTERP} ${CMAKE_SOURCE_DIR}/api/lua/test_shoal_lua_tools.lua
                   ${CMAKE_SOURCE_DIR}/models/smollm2-135m-instruct-q4_1.gguf
           WORKING_DIRECTORY ${CMAKE_SOURCE_DIR})
  set_tests_properties(test_lua_module_tools PROPERTIES ENVIRONMENT "${_sh_lua_env}"
                       REQUIRED_FILES $<TARGET_FILE:shoal_lua> SKIP_RETURN_CODE 77)
else()
  foreach(_t test_lua_module test_lua_module_tools)
    add_test(NAME ${_t}
             COMMAND sh -c "echo 'skipped: lua5.4 is not installed (scripts/bootstrap.sh)'; exit 77")
    set_tests_properties(${_t} PROPERTIES SKIP_RETURN_CODE 77)
  endforeach()
endif()
set_tests_properties(test_lua_module test_lua_module_tools PROPERTIES LABELS unit TIMEOUT 120)
