/* libFuzzer target for the GGUF reader and the model loader on top of it: open arbitrary bytes
 * and, when they open, touch every value and every tensor's first and last byte; then load them
 * as a model (through a memfd, since the loader maps a path), which either fails with a message
 * or binds weights that lie inside the file (every page of them is read). */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "model/gguf.h"
#include "model/llama.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static volatile unsigned sink;

static void walk_value(const sh_gguf_value *v)
{
    if (v->type == SH_GGUF_STRING) {
        if (v->v.s.len)
            sink += (unsigned char)v->v.s.ptr[0] + (unsigned char)v->v.s.ptr[v->v.s.len - 1];
        return;
    }
    if (v->type != SH_GGUF_ARRAY) {
        sink += (unsigned)v->v.u;
        return;
    }
    for (uint64_t i = 0; i < v->v.arr.n; i++) {
        if (v->v.arr.type == SH_GGUF_STRING) {
            sh_gguf_value s = {.type = SH_GGUF_STRING, .v.s = v->v.arr.strs[i]};
            walk_value(&s);
        } else if (v->v.arr.type == SH_GGUF_ARRAY) {
            walk_value(&v->v.arr.vals[i]);
        } else {
            sink += (unsigned)sh_gguf_arr_u64(v, i) + (unsigned)sh_gguf_arr_i64(v, i) +
                    (unsigned)(sh_gguf_arr_f64(v, i) != 0);
        }
    }
}

/* The loader's promise on any file the reader accepts: SH_OK with a model whose weights lie in
 * the file (prefault reads a byte of every page of them), or an error with a message and no
 * model. */
static void load_model(const uint8_t *data, size_t size)
{
    static int fd = -1;
    if (fd < 0 && (fd = memfd_create("fuzz_gguf", 0)) < 0)
        return;
    if (ftruncate(fd, 0) || pwrite(fd, data, size, 0) != (ssize_t)size)
        return;
    char path[64];
    snprintf(path, sizeof path, "/proc/self/fd/%d", fd);
    sh_llama *m = NULL;
    sh_error e = {0};
    sh_llama_load_opts o = {.prefault = true};
    if (sh_llama_load(path, &o, &m, &e) != SH_OK) {
        if (!e.msg[0] || m)
            __builtin_trap();
        return;
    }
    const sh_llama_hparams *hp = &m->hp;
    if (hp->n_layers < 1 || hp->dim < 1 || hp->n_vocab < 1 || hp->n_heads < 1 ||
        hp->n_expert_used > hp->n_expert)
        __builtin_trap();
    sh_llama_destroy(m);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
    sh_gguf *g = NULL;
    sh_error e;
    if (sh_gguf_open_mem(data, size, &g, &e) != SH_OK) {
        /* Every failure carries a message. */
        if (!e.msg[0] || g)
            __builtin_trap();
        return 0;
    }
    for (uint64_t i = 0; i < sh_gguf_n_kv(g); i++) {
        const sh_gguf_kv *kv = sh_gguf_kv_at(g, i);
        walk_value(&kv->value);
        char key[64];
        if (kv->key.len < sizeof key) {
            memcpy(key, kv->key.ptr, kv->key.len);
            key[kv->key.len] = '\0';
            sink += sh_gguf_find(g, key) != NULL;
            uint32_t u;
            float f;
            sh_str s;
            sink += sh_gguf_get_u32(g, key, &u) + sh_gguf_get_f32(g, key, &f) +
                    sh_gguf_get_str(g, key, &s);
        }
    }
    for (uint64_t i = 0; i < sh_gguf_n_tensors(g); i++) {
        const sh_gguf_tensor *t = sh_gguf_tensor_at(g, i);
        const uint8_t *p = t->data;
        if ((const uint8_t *)t->data < data || t->nbytes > size ||
            p - data > (ptrdiff_t)(size - t->nbytes))
            __builtin_trap(); /* the reader promised the data lies inside the input */
        sink += p[0] + p[t->nbytes - 1];
        char name[64];
        if (t->name.len < sizeof name) {
            memcpy(name, t->name.ptr, t->name.len);
            name[t->name.len] = '\0';
            sink += sh_gguf_find_tensor(g, name) != NULL;
        }
    }
    sh_gguf_close(g);
    load_model(data, size);
    return 0;
}
