/* libFuzzer target for the GGUF reader: open arbitrary bytes and, when they open, touch every
 * value and every tensor's first and last byte. */
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "model/gguf.h"

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
    return 0;
}
