/* Golden files written by tests/reference/ref_forward.py --golden, and the comparison of a
 * model's logits with them along the sequence (teacher forcing). */
#ifndef SH_TEST_GOLDEN_REF_H
#define SH_TEST_GOLDEN_REF_H

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "llama_driver.h"

enum { MAX_P = 4, MAX_IDS = 64, TOPK = 8 };

typedef struct golden {
    char name[32];
    int32_t n_prompt, prompt[MAX_IDS];
    int32_t n_gen, gen[MAX_IDS];
    int32_t n_top; /* positions with a top line: n_prompt + n_gen - 1 */
    int32_t top_id[2 * MAX_IDS][TOPK];
    float top_lg[2 * MAX_IDS][TOPK];
} golden;

static golden gp[MAX_P];
static int n_gp;

static bool parse_golden(const char *prefix)
{
    char path[256];
    snprintf(path, sizeof path, "%s.txt", prefix);
    n_gp = 0;
    memset(gp, 0, sizeof gp);
    FILE *f = fopen(sh_test_path(path), "r");
    if (!f)
        return false;
    char word[32];
    while (fscanf(f, "%31s", word) == 1) {
        if (word[0] == '#') {
            int ch;
            while ((ch = fgetc(f)) != '\n' && ch != EOF)
                ;
        } else if (!strcmp(word, "prompt") && n_gp < MAX_P) {
            golden *g = &gp[n_gp++];
            if (fscanf(f, "%31s %d", g->name, &g->n_prompt) != 2 || g->n_prompt > MAX_IDS)
                break;
            for (int i = 0; i < g->n_prompt; i++)
                if (fscanf(f, "%d", &g->prompt[i]) != 1)
                    return false;
        } else if (!strcmp(word, "greedy") && n_gp > 0) {
            golden *g = &gp[n_gp - 1];
            if (fscanf(f, "%d", &g->n_gen) != 1 || g->n_gen > MAX_IDS)
                return false;
            for (int i = 0; i < g->n_gen; i++)
                if (fscanf(f, "%d", &g->gen[i]) != 1)
                    return false;
        } else if (!strcmp(word, "top") && n_gp > 0) {
            golden *g = &gp[n_gp - 1];
            int pos, k;
            if (fscanf(f, "%d %d", &pos, &k) != 2 || pos < 0 || pos >= 2 * MAX_IDS || k != TOPK)
                return false;
            for (int j = 0; j < k; j++)
                if (fscanf(f, "%d %f", &g->top_id[pos][j], &g->top_lg[pos][j]) != 2)
                    return false;
            if (pos + 1 > g->n_top)
                g->n_top = pos + 1;
        }
    }
    fclose(f);
    return n_gp > 0;
}

/* Teacher forcing: feeds prompt + reference continuation to the model at `path` and compares
 * the logits of every row with the reference: the top-8 entries along the sequence and the full
 * row at the prompt's last position, relative to the largest reference logit magnitude. */
static void compare_logits(const char *path, const char *prefix, double tol, bool need_top1,
                           double margin)
{
    drv d;
    if (!drv_open(&d, path, 2, 2 * MAX_IDS, 1, 256))
        return;
    int32_t V = d.m->hp.n_vocab;
    static float last[1 << 18]; /* Gemma 3: 262144 */
    for (int p = 0; p < n_gp; p++) {
        golden *g = &gp[p];
        int32_t seq[2 * MAX_IDS], n = 0;
        for (int i = 0; i < g->n_prompt; i++)
            seq[n++] = g->prompt[i];
        for (int i = 0; i + 1 < g->n_gen; i++)
            seq[n++] = g->gen[i];
        const float *lg = drv_feed(&d, seq, n, 0, true);
        if (!lg)
            break;
        double worst = 0.0;
        int agree = 0, flips = 0;
        for (int32_t r = 0; r < n && r < g->n_top; r++) {
            const float *row = lg + (size_t)r * V;
            double scale = fabs(g->top_lg[r][0]), err = 0.0;
            for (int j = 0; j < TOPK; j++) {
                double e = fabs(row[g->top_id[r][j]] - g->top_lg[r][j]);
                err = e > err ? e : err;
                scale = fabs(g->top_lg[r][j]) > scale ? fabs(g->top_lg[r][j]) : scale;
            }
            worst = err / scale > worst ? err / scale : worst;
            int32_t top1 = argmax(row, V);
            agree += top1 == g->top_id[r][0];
            if (top1 != g->top_id[r][0] &&
                (need_top1 || g->top_lg[r][0] - g->top_lg[r][1] > margin)) {
                flips++;
                SH_FAIL_("%s row %d: top-1 %d, reference %d by a margin of %.3f", g->name, (int)r,
                         (int)top1, (int)g->top_id[r][0],
                         (double)(g->top_lg[r][0] - g->top_lg[r][1]));
            }
        }
        char lpath[128];
        snprintf(lpath, sizeof lpath, "%s.%.31s.last.f32", prefix, g->name);
        FILE *f = fopen(sh_test_path(lpath), "rb");
        double full = -1.0;
        if (f && fread(last, sizeof(float), (size_t)V, f) == (size_t)V) {
            const float *row = lg + (size_t)(g->n_prompt - 1) * V;
            double mx = 0.0, err = 0.0;
            for (int32_t v = 0; v < V; v++) {
                mx = fabs(last[v]) > mx ? fabs(last[v]) : mx;
                err = fabs(row[v] - last[v]) > err ? fabs(row[v] - last[v]) : err;
            }
            full = err / mx;
            CHECK(full <= tol);
        } else {
            SH_FAIL_("cannot read %s", lpath);
        }
        if (f)
            fclose(f);
        fprintf(stderr,
                "%-7s rows %2d: top-1 agreement %d/%d, max rel error top-%d %.2e, full last row "
                "%.2e (tolerance %.0e)\n",
                g->name, (int)n, agree, (int)n, TOPK, worst, full, tol);
        CHECK(worst <= tol);
        CHECK_INT_EQ(flips, 0);
    }
    drv_close(&d);
}

/* The model file of a golden prefix: "<prefix>.gguf" under the source tree. Two calls' results
 * may be live at once. */
static inline const char *golden_model_path(const char *prefix)
{
    static char buf[2][512];
    static int k;
    char *b = buf[k++ & 1];
    snprintf(b, sizeof buf[0], "%s.gguf", sh_test_path(prefix));
    return b;
}

/* The whole golden check of the tiny model of `prefix` against its reference: logits along
 * prompt + greedy continuation (teacher forcing) within 1e-5 of the largest reference logit, the
 * same top-1 everywhere, and the reference's greedy ids (a 256-token context, as compare_logits
 * uses). Static inline: not every test that includes this file uses it. */
static inline void golden_check_reference(const char *prefix)
{
    const char *path = golden_model_path(prefix);
    if (!parse_golden(prefix)) {
        SH_FAIL_("cannot parse %s.txt", prefix);
        return;
    }
    compare_logits(path, prefix, 1e-5, true, 0.0);
    drv d;
    if (!drv_open(&d, path, 1, 2 * MAX_IDS, 1, 256))
        return;
    for (int p = 0; p < n_gp; p++) {
        int32_t gen[MAX_IDS];
        CHECK_INT_EQ(drv_greedy(&d, gp[p].prompt, gp[p].n_prompt, gp[p].n_gen, gen), gp[p].n_gen);
        for (int i = 0; i < gp[p].n_gen; i++)
            if (gen[i] != gp[p].gen[i]) {
                SH_FAIL_("%s %s: greedy id %d is %d, reference %d", prefix, gp[p].name, i,
                         (int)gen[i], (int)gp[p].gen[i]);
                break;
            }
    }
    drv_close(&d);
}

/* A broken model file at `path`: the load fails with `code` and a message containing `needle`;
 * and, when SH_SHOAL names the binary, `shoal run` on it prints exactly one `error:` line naming
 * `needle` and exits 2. */
static inline void golden_expect_load_fail(const char *path, sh_err code, const char *needle)
{
    sh_llama *m = NULL;
    sh_error e = {0};
    CHECK_INT_EQ(sh_llama_load(path, NULL, &m, &e), code);
    CHECK(m == NULL);
    if (!strstr(e.msg, needle))
        SH_FAIL_("error '%s' does not name '%s'", e.msg, needle);
    const char *shoal = getenv("SH_SHOAL");
    if (!shoal)
        return;
    char cmd[2048], errf[600];
    snprintf(errf, sizeof errf, "%s.err", path);
    snprintf(cmd, sizeof cmd, "'%s' run -m '%s' -n 1 --prompt-ids 1 >/dev/null 2>'%s'", shoal, path,
             errf);
    int st = system(cmd);
    CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 2);
    FILE *f = fopen(errf, "r");
    char line[1024] = "";
    int lines = 0;
    while (f && fgets(line, sizeof line, f))
        lines++;
    if (f)
        fclose(f);
    CHECK_INT_EQ(lines, 1);
    fprintf(stderr, "shoal run: %s", line);
    if (strncmp(line, "error:", 6) != 0 || !strstr(line, needle))
        SH_FAIL_("shoal run said '%s', expected one error line naming '%s'", line, needle);
    unlink(errf);
}

#endif
