-- wrk script: PUT /items/bench-N with a 100-byte document, N random in [0, 100000).
-- wrk -t2 -c64 -d10s -s examples/wrk-put.lua http://127.0.0.1:8080
-- (against `shardgrid dev --tls`: https://127.0.0.1:8080; wrk does not verify the certificate)
wrk.method = "PUT"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"v":"' .. string.rep("x", 100) .. '"}'
request = function()
  return wrk.format(nil, "/items/bench-" .. math.random(0, 99999))
end
