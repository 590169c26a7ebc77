/* Unit tests of the chat templates: detection from template text and exact rendered prompts. */
#include "model/chat.h"
#include "sh_test.h"

static const char *render(sh_chat_template t, const sh_chat_msg *m, size_t n, const char *sys)
{
    static char buf[1024];
    size_t len = 0;
    sh_error e = {0};
    if (sh_chat_render(t, m, n, sys, true, buf, sizeof buf, &len, &e)) {
        fprintf(stderr, "render: %s\n", e.msg);
        return "(error)";
    }
    CHECK_UINT_EQ(len, strlen(buf));
    return buf;
}

static const char smollm_tmpl[] =
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + "
    "message['content'] + '<|im_end|>' + '\n'}}{% endfor %}";

static void test_detect(void)
{
    CHECK_INT_EQ(sh_chat_detect(smollm_tmpl, strlen(smollm_tmpl)), SH_CHAT_CHATML);
    const char *l3 = "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>' }}";
    CHECK_INT_EQ(sh_chat_detect(l3, strlen(l3)), SH_CHAT_LLAMA3);
    const char *l2 = "{{ bos_token + '[INST] ' + content + ' [/INST]' }}";
    CHECK_INT_EQ(sh_chat_detect(l2, strlen(l2)), SH_CHAT_LLAMA2);
    const char *z = "{{ '<|user|>\n' + message['content'] + eos_token }}";
    CHECK_INT_EQ(sh_chat_detect(z, strlen(z)), SH_CHAT_ZEPHYR);
    CHECK_INT_EQ(sh_chat_detect(NULL, 0), SH_CHAT_CHATML);
    CHECK_STR_EQ(sh_chat_name(SH_CHAT_LLAMA3), "llama3");
}

static void test_default_system(void)
{
    char buf[256];
    CHECK(sh_chat_default_system(smollm_tmpl, strlen(smollm_tmpl), buf, sizeof buf));
    CHECK_STR_EQ(buf, "You are a helpful AI assistant named SmolLM, trained by Hugging Face");
    const char *esc = "'<|im_start|>system\\nBe brief.<|im_end|>\\n'";
    CHECK(sh_chat_default_system(esc, strlen(esc), buf, sizeof buf));
    CHECK_STR_EQ(buf, "Be brief.");
    const char *none = "{{'<|im_start|>' + message['role'] }}";
    CHECK(!sh_chat_default_system(none, strlen(none), buf, sizeof buf));
    CHECK_STR_EQ(buf, "");
}

static void test_render(void)
{
    sh_chat_msg m[3] = {{"user", "Hi"}, {"assistant", "Hello!"}, {"user", "2+2?"}};
    CHECK_STR_EQ(render(SH_CHAT_CHATML, m, 1, "Sys"),
                 "<|im_start|>system\nSys<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                 "<|im_start|>assistant\n");
    CHECK_STR_EQ(render(SH_CHAT_CHATML, m, 3, NULL),
                 "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n"
                 "<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n");
    CHECK_STR_EQ(render(SH_CHAT_LLAMA3, m, 1, NULL),
                 "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|>"
                 "<|start_header_id|>assistant<|end_header_id|>\n\n");
    CHECK_STR_EQ(render(SH_CHAT_ZEPHYR, m, 1, "S"),
                 "<|system|>\nS</s>\n<|user|>\nHi</s>\n<|assistant|>\n");
    CHECK_STR_EQ(render(SH_CHAT_LLAMA2, m, 3, "S"),
                 "[INST] <<SYS>>\nS\n<</SYS>>\n\nHi [/INST] Hello! </s><s>[INST] 2+2? [/INST]");
    sh_chat_msg withsys[2] = {{"system", "Own"}, {"user", "Hi"}};
    CHECK_STR_EQ(render(SH_CHAT_CHATML, withsys, 2, "Default"),
                 "<|im_start|>system\nOwn<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                 "<|im_start|>assistant\n");
}

static void test_too_small(void)
{
    sh_chat_msg m[1] = {{"user", "Hi"}};
    char small[8];
    size_t len = 0;
    CHECK_INT_EQ(sh_chat_render(SH_CHAT_CHATML, m, 1, NULL, true, small, sizeof small, &len, NULL),
                 SH_ERANGE);
    CHECK_UINT_EQ(len, strlen("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"));
    sh_chat_msg bad[1] = {{NULL, "x"}};
    char buf[64];
    CHECK_INT_EQ(sh_chat_render(SH_CHAT_CHATML, bad, 1, NULL, true, buf, sizeof buf, &len, NULL),
                 SH_EINVAL);
}

static const sh_test_case tests[] = {
    {"detect", test_detect},
    {"default_system", test_default_system},
    {"render", test_render},
    {"too_small", test_too_small},
    {NULL, NULL},
};

int main(int argc, char **argv) { return sh_test_main(argc, argv, tests); }
