# test_embedding_doc: the complete program of docs/embedding.md, extracted from the page at build
# time (between its embedding-doc-program markers), compiled as C99 with the project's warnings
# and run against stories260K, so the page's program compiles and works exactly as written.
set(_sh_doc_c ${CMAKE_BINARY_DIR}/tests/embedding_doc_program.c)
add_custom_command(
  OUTPUT ${_sh_doc_c}
  COMMAND sh -c "awk '/<!-- embedding-doc-program: end -->/{f=0} f && !/^```/{print} /<!-- embedding-doc-program: begin -->/{f=1}' \"$0\" > \"$1\" && test -s \"$1\""
          ${CMAKE_SOURCE_DIR}/docs/embedding.md ${_sh_doc_c}
  DEPENDS ${CMAKE_SOURCE_DIR}/docs/embedding.md
  COMMENT "Extracting the program of docs/embedding.md"
  VERBATIM)
sh_test(test_embedding_doc SOURCES ${_sh_doc_c} LABELS unit TIMEOUT 60
        ARGS ${CMAKE_SOURCE_DIR}/tests/data/stories260K/stories260K.gguf)
if(TARGET test_embedding_doc)
  set_target_properties(test_embedding_doc PROPERTIES C_STANDARD 99 C_EXTENSIONS OFF)
endif()
