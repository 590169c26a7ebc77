/* The smallest Shoal host: prints the version of the library it runs with and, given a model
 * file, opens an engine on it and prints what the model is. It proves that a program builds
 * against an installed Shoal (its Makefile through pkg-config, its CMakeLists.txt through
 * find_package(Shoal)) and runs with the installed libshoal.so.
 * Usage: hello [MODEL.gguf] */
#include <shoal.h>

#include <stdio.h>

int main(int argc, char **argv)
{
    sh_engine_opts o;
    sh_engine *eng;
    sh_model_info mi;
    sh_error e;
    sh_err rc;

    /* sh_version() is the library's; SH_VERSION_STRING is the header's this program was built
     * with. They differ when the program runs with another release of libshoal.so. */
    printf("shoal %s (built with the %s header, API version %d)\n", sh_version(), SH_VERSION_STRING,
           SH_API_VERSION);
    if (argc < 2)
        return 0;

    o = sh_engine_opts_default();
    o.model_path = argv[1];
    o.threads = 1;
    rc = sh_engine_open(&o, &eng, &e);
    if (rc != SH_OK) {
        fprintf(stderr, "hello: %s: %s\n", sh_strerror(rc), e.msg);
        return 1;
    }
    rc = sh_model_info_get(eng, &mi);
    if (rc == SH_OK)
        printf("model %s: %s, %s weights, %d layers, dim %d, vocab %d, context %d, %.1f M "
               "parameters\n",
               mi.name, mi.arch, mi.weight_type, (int)mi.n_layers, (int)mi.dim, (int)mi.n_vocab,
               (int)mi.n_ctx, (double)mi.n_params / 1e6);
    else
        fprintf(stderr, "hello: sh_model_info_get: %s\n", sh_strerror(rc));
    sh_engine_close(eng);
    return rc == SH_OK ? 0 : 1;
}
