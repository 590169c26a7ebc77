/* Golden files written by tests/reference/ref_forward.py --golden, and the comparison of a
 * model's logits with them along the sequence (teacher forcing). */
#ifndef SH_TEST_GOLDEN_REF_H
#define SH_TEST_GOLDEN_REF_H

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

#endif
